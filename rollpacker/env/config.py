"""The episodes' config (``[env]``): the environment, its tools, the episode's limits, the workers.

Plain dataclasses only (no torch): configs are parsed before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollpacker.choices import check_choices

OnError = Literal["skip", "fail"]
FACTORIES = {"toy": "rollpacker.toy.env:make_env"}
"""Built-in environments of ``env.factory``, by name."""
TOOLS = {"python": "rollpacker.env.tools:python"}
"""Built-in tools of ``env.tools``, by name."""


@dataclass(kw_only=True)
class EnvConfig:
    factory: str = ""
    """The environment: path/to/file.py:make_env, package.module:make_env (a function or class of the row) or toy."""
    tools: tuple[str, ...] = ()
    """Python functions the model may call: path/to/file.py:fn, package.module:fn, or python (code in the sandbox)."""
    max_tool_result_chars: int = 4000
    """A tool result (or a failed call's error) longer than this many characters keeps its start and end, around a
    marker of how many were cut (verl's max_tool_response_length, in characters); 0 = no limit."""
    tool_parser: str = "hermes"
    """How tool calls are read from the model's text, in its family's format: hermes (Qwen2.5, Qwen3), qwen3_coder
    (Qwen3-Coder's XML), llama3_json (Llama 3.1-3.3's JSON) or mistral ([TOOL_CALLS]); see docs/environments.md."""
    max_turns: int = 4
    """Model turns per episode at most."""
    max_tokens: int = 0
    """Model tokens per episode at most, all turns together (0: rollout.max_new_tokens)."""
    timeout: float = 30.0
    """Wall-clock seconds one environment call (reset, step with its tool calls, close) may take, then it is killed."""
    start_timeout: float = 300.0
    """Seconds an environment worker may take to start: to import env.factory's and env.tools' modules and run the
    factory's warm_up() (a verifiers environment's load), counted against no call's timeout. Longer stops the run."""
    reset_retries: int = 0
    """Open an environment again when its make_env or reset raised, hung past env.timeout or lost its worker (a
    sandbox that failed to start), up to this many times; a step is never retried."""
    reset_retry_delay: float = 1.0
    """Seconds before the first retry of a reset, doubled for each one after it."""
    on_error: OnError = "skip"
    """An environment that raises, hangs or returns garbage: skip (its episode ends untrained; env/errors) or fail."""
    max_error_frac: float = 0.5
    """Stop after a step where over this share of the episodes, or of its step calls (8 or more), failed in their
    environment (1: never)."""
    observation_role: Literal["user", "tool", "system"] = "user"
    """The chat role of an observation given as a string."""
    num_workers: int = 2
    """Environment worker processes (environments live there, one episode's on one worker)."""
    warm: bool = False
    """Open the next round's first environments while a step trains, so their resets (a cold start) run ahead."""
    template_breaks: Literal["fail", "count"] = "fail"
    """A chat template that is not prefix-preserving for an observation: fail, or count it (env/template_breaks)."""

    def __post_init__(self) -> None:
        check_choices(self, "env")
        from rollpacker.env.parsers import PARSERS
        from rollpacker.imports import check_spec

        if self.factory:
            check_spec(self.factory, "env.factory", FACTORIES)
        for spec in self.tools:
            check_spec(spec, "env.tools", TOOLS)
        if len(set(self.tools)) < len(self.tools):
            raise ValueError(f"env.tools names a tool twice: {list(self.tools)}")
        if self.tool_parser not in PARSERS:
            raise ValueError(f"env.tool_parser must be one of {', '.join(PARSERS)}, got {self.tool_parser!r}")
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_tool_result_chars < 0:
            raise ValueError(f"env.max_tool_result_chars must be >= 0 (0: no limit), got {self.max_tool_result_chars}")
        if self.max_tokens < 0:
            raise ValueError(f"env.max_tokens must be >= 0 (0: rollout.max_new_tokens), got {self.max_tokens}")
        if not 0 <= self.max_error_frac <= 1:
            raise ValueError(f"env.max_error_frac must be in [0, 1] (1: never stop), got {self.max_error_frac}")
        if self.reset_retries < 0 or self.reset_retry_delay < 0:
            raise ValueError(f"env.reset_retries and env.reset_retry_delay must be >= 0, got {self.reset_retries} "
                             f"and {self.reset_retry_delay}")
        for name in ("timeout", "start_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"env.{name} must be positive, got {getattr(self, name)}")
        if self.num_workers < 1:
            raise ValueError(f"env.num_workers must be >= 1 (environments run in killable workers), got "
                             f"{self.num_workers}")

    @property
    def enabled(self) -> bool:
        """Responses are episodes: an environment or tools are set."""
        return bool(self.factory or self.tools)
