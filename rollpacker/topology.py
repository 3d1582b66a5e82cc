"""The job's shape as plain data: who rolls out, who trains, which replicas a scale-down keeps.

:class:`Topology` is computed once from the settings and the world size. It imports nothing
(no torch), so the config checks, the meshes, the stream trainer, the simulator and the memory
plan all read the same numbers.

- Ranks ``0 .. rollout_ranks - 1`` roll out, as ``num_replicas`` replicas of ``tp`` ranks each.
- Every rank trains, or, with pools of its own (``one_step_off``), the ranks that do not roll out.
- Training shards over groups of ``shard`` ranks; each group of groups is a whole replica.
- A scale-down (stream training, RolloutPipe) keeps the first half of the replicas, rounded up.
  The other replicas' ranks are freed to train, so they must be whole training shard groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


def kept_replicas(num_replicas: int) -> int:
    """The replicas that keep rolling out after a scale-down: the first half, rounded up."""
    return num_replicas - num_replicas // 2


@dataclass(frozen=True)
class Topology:
    """The ranks of a job of ``world`` ranks (GPUs, in the simulator)."""

    world: int
    tp: int = 1
    """Ranks per rollout replica."""
    rollout_ranks: int = 0
    """The ranks rolling out, the first ones; 0 = all."""
    pools: bool = False
    """Rollout and training run on separate ranks (a policy with pools of its own)."""
    train_shard_size: int = 0
    """Ranks one training replica shards over; 0 = every training rank."""

    def __post_init__(self) -> None:
        if not self.rollout_ranks and not self.pools:
            object.__setattr__(self, "rollout_ranks", self.world)

    def with_tp(self, tp: int) -> Topology:
        """The same job with rollout replicas of ``tp`` ranks."""
        return replace(self, tp=tp)

    @property
    def rollout(self) -> list[int]:
        return list(range(self.rollout_ranks))

    @property
    def train(self) -> list[int]:
        """The ranks that train: all, or those that do not roll out with pools."""
        return list(range(self.rollout_ranks, self.world)) if self.pools else list(range(self.world))

    @property
    def shard(self) -> int:
        """Ranks per training shard group."""
        return self.train_shard_size or len(self.train)

    @property
    def num_replicas(self) -> int:
        return self.rollout_ranks // self.tp

    @property
    def kept_replicas(self) -> int:
        return kept_replicas(self.num_replicas)

    @property
    def kept_ranks(self) -> list[int]:
        """The ranks that keep rolling out after a scale-down."""
        return list(range(self.kept_replicas * self.tp))

    @property
    def freed_ranks(self) -> list[int]:
        """The ranks a scale-down frees to train: every rank after the kept replicas'."""
        return list(range(self.kept_replicas * self.tp, self.world))

    @property
    def refused(self) -> str:
        """Why no scale-down can happen ("" when one can): nothing to free, or a split shard group."""
        freed = self.freed_ranks
        if self.num_replicas < 2:
            return f"one rollout replica ({self.world} ranks, rollout.tp={self.tp}): nothing to free"
        if freed[0] % self.shard:
            fits = [n for n in range(1, freed[0] + 1) if freed[0] % n == 0 and len(self.train) % n == 0]
            return (f"freeing ranks {freed[0]}..{freed[-1]} would split a training shard group of {self.shard} "
                    f"ranks: set train.train_shard_size to {' or '.join(map(str, fits))} (divisors of both "
                    f"{freed[0]} and the {len(self.train)} training ranks)")
        return ""

    def check(self, unit: str = "ranks") -> None:
        """A ValueError naming the setting when the pools, the rollout TP or the shard size do not
        fit the world (``unit``: what a rank is called in the message)."""
        world, pool = self.world, self.rollout_ranks
        if self.pools and world < 2:
            raise ValueError(f"a rollout pool and a training pool need at least 2 {unit}; this run has {world}: "
                             "launch it with torchrun --nproc_per_node=2 or more")
        if self.pools and not 0 < pool < world:
            raise ValueError(f"schedule.rollout_ranks={pool} must be between 1 and {world - 1} on {world} {unit} "
                             "(the others train)")
        if pool % self.tp:
            where = f"the {pool} rollout {unit} (schedule.rollout_ranks)" if self.pools else f"the world size {world}"
            raise ValueError(f"rollout.tp={self.tp} does not divide {where}")
        train = len(self.train)
        if train % self.shard:
            where = f"the {train} training {unit}" if self.pools else f"the world size {world}"
            raise ValueError(f"train.train_shard_size={self.shard} does not divide {where}")
