"""The reward scheduler's config: worker pool, failure policy, adaptive code timeouts, sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollpacker.reward.sandbox import SandboxConfig

ON_ERROR = ("zero", "drop")


@dataclass(kw_only=True)
class RewardConfig:
    num_workers: int = 4
    """Reward worker processes: each scores one sample at a time and is killed if it hangs (0: score
    inline in the controller, for debugging: nothing can stop a hung reward there)."""
    timeout: float = 10.0
    """Wall-clock seconds one sample may take to score; a code sample gets its tests' timeouts on top."""
    on_error: str = "zero"
    """A sample whose reward failed (flagged reward_error): zero (train on it with reward 0) or drop it."""
    timeout_factor: float = 1.5
    """Code: lambda, a test's timeout is lambda times the slowest correct run seen on it (RollPacker's code uses 2)."""
    timeout_min: float = 2.0
    """Code: shortest timeout of a test case, in seconds (also the timeout before any correct run)."""
    timeout_max: float = 30.0
    """Code: longest timeout of a test case, in seconds."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Isolation and limits of the code sandbox."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"reward.on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        for name in ("timeout", "timeout_factor", "timeout_min"):
            if getattr(self, name) <= 0:
                raise ValueError(f"reward.{name} must be positive, got {getattr(self, name)}")
        if self.timeout_max < self.timeout_min:
            raise ValueError(f"reward.timeout_max ({self.timeout_max}) must be >= reward.timeout_min ({self.timeout_min})")
