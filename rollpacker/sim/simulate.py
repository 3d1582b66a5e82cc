"""The simulated job: the real scheduling policies driven through simulated engine replicas.

:func:`simulate_round` is :func:`rollpacker.controller.run_round` with simulated time: the same
policy object gets the same calls in the same order. Requests are routed round-robin per request
over the replicas; every finished response is handed to ``policy.on_finished`` in completion-time
order (responses finishing at the same instant in replica order, as the controller gathers
them), with its reward when the policy ``needs_rewards`` and None otherwise; the policy's aborts
are sent only for requests still outstanding, its launches take the next slots, and when it says
the round is over (or nothing is left running) everything still running is aborted,
``policy.end_round`` gets the partial outputs and the kept groups get their rewards. The outputs
the policy keeps are :class:`~rollpacker.sim.engine.Seq` records (``id``, ``length``,
``finish_time``). Scoring is instant as far as the policy's decisions go (the controller's reward
scheduler with fast rewards); what scoring costs is charged by :func:`step_times`.

:func:`step_times` turns a round into the stages of an RL step, in veRL's synchronous order:
rollout, then scoring the kept responses (:meth:`RewardModel.stage_s`), training on them
(:meth:`CostModel.train_s`), and the weight sync. A policy or stage optimization that overlaps
stages (reward scheduler, stream trainer) plugs in here: it gets the round's completion times
(``RoundRecord.completions``) and the per-replica activity, and says what part of each stage is
exposed.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from rollpacker.config import POLICIES
from rollpacker.data.dataset import PromptSampler
from rollpacker.metrics import bubble_ratio
from rollpacker.schedule.base import Group, request_id
from rollpacker.schedule.sync import SyncPolicy
from rollpacker.schedule.tail import TailPolicy
from rollpacker.sim.cost import HARDWARE, MODELS, Calibration, CostModel
from rollpacker.sim.engine import Replica, Seq
from rollpacker.sim.workload import LengthModel, RewardModel, TraceLengths, adaptive_timeouts, read_length_trace



@dataclass(kw_only=True)
class SimConfig:
    model: str = "qwen2.5-14b"
    """Actor model: one of rollpacker.sim.cost.MODELS."""
    hardware: str = "H800"
    """GPU kind: one of rollpacker.sim.cost.HARDWARE (the paper's cluster is H800)."""
    gpus: int = 32
    """GPUs of the job: rollout replicas of TP size tp, then all of them train."""
    tp: int = 2
    """Rollout TP size of every engine replica."""
    num_prompts: int = 128
    """P0: prompts trained per step."""
    group_size: int = 8
    """R0: responses per prompt."""
    max_new_tokens: int = 16384
    """Longest response (longer natural lengths are cut here)."""
    policy: str = "tail"
    """Scheduling policy: sync (veRL) or tail (tail batching)."""
    eta_prompts: float = 1.25
    """tail: prompts launched per short round, over P0."""
    eta_responses: float = 1.25
    """tail: responses launched per prompt in short rounds, over R0."""
    reward_scheduler: bool = False
    """§4.3: score each response as it finishes (overlapped with rollout), adaptive code timeouts, the
    judge colocated on every GPU; else scoring starts after rollout."""
    num_steps: int = 20
    """RL steps simulated (20 = four tail-batching periods of 4 short rounds and 1 long round)."""
    num_rows: int = 100_000
    """Prompts in the dataset."""
    max_num_seqs: int = 1024
    """Most requests running on one replica."""
    max_prefill_tokens: int = 16384
    """Most tokens prefilled by one replica in one iteration."""
    trace: str = ""
    """JSONL of recorded response lengths to replay instead of the length mixture (e.g. a run's metrics.jsonl)."""
    seed: int = 0
    """Seeds the prompt order, the lengths and the reward times."""
    lengths: LengthModel = field(default_factory=LengthModel)
    reward: RewardModel = field(default_factory=RewardModel)
    calib: Calibration = field(default_factory=Calibration)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"sim.model must be one of {sorted(MODELS)}, got {self.model!r}")
        if self.hardware not in HARDWARE:
            raise ValueError(f"sim.hardware must be one of {sorted(HARDWARE)}, got {self.hardware!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"sim.policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("gpus", "tp", "num_prompts", "group_size", "max_new_tokens", "num_steps", "num_rows",
                     "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sim.{name} must be positive, got {getattr(self, name)}")
        if self.gpus % self.tp:
            raise ValueError(f"sim.tp={self.tp} does not divide sim.gpus={self.gpus}")

    @property
    def num_replicas(self) -> int:
        return self.gpus // self.tp

    def cost(self) -> CostModel:
        return CostModel(HARDWARE[self.hardware], MODELS[self.model], self.tp, self.calib)

    def workload(self):
        if not self.trace:
            return self.lengths.for_cap(self.max_new_tokens)
        groups = read_length_trace(self.trace, self.group_size)
        return TraceLengths(tuple(map(tuple, groups)), self.lengths.prompt_tokens, self.seed)

    def build_policy(self):
        sampler = PromptSampler(self.num_rows, seed=self.seed)
        if self.policy == "sync":
            return SyncPolicy(sampler, self.num_prompts, self.group_size)
        return TailPolicy(sampler, self.num_prompts, self.group_size, eta_prompts=self.eta_prompts,
                          eta_responses=self.eta_responses)


@dataclass
class RoundRecord:
    kind: str
    rollout_s: float
    groups: list[Group]
    num_launched: int
    aborted: list[Seq]
    generated_tokens: int
    """Tokens generated in the round, kept or thrown away."""
    num_preemptions: int
    bubble_ratio: float
    completions: list[tuple[float, str]]
    """(time, request id) of every finished response, in the order the policy was told."""
    busy: list[list[tuple[float, float, int]]] | None = None
    """Per replica: (start, end, running requests) of its activity, when recorded."""


def build_replicas(cost: CostModel, num_replicas: int, *, max_num_seqs: int = 1024, max_prefill_tokens: int = 16384,
                   record: bool = False) -> list[Replica]:
    capacity = cost.kv_capacity_tokens()
    return [Replica(i, cost, capacity, max_num_seqs, max_prefill_tokens, record=record) for i in range(num_replicas)]


def simulate_round(step: int, policy, replicas: list[Replica], lengths, *, max_new_tokens: int,
                   reward=lambda row, seq: None) -> RoundRecord:
    """One round of ``policy`` on fresh ``replicas`` (time starts at 0), as the controller runs it.

    ``lengths.lengths(row, step, slot, n)`` gives the natural lengths of a launch (cut at
    ``max_new_tokens``), ``lengths.prompt_tokens`` the prompt size; ``reward(row, seq)`` the reward
    of a response (handed to the policy when it ``needs_rewards``, and set on the kept groups)."""
    needs_rewards = getattr(policy, "needs_rewards", False)
    plan = policy.start_round(step)
    rows: list[int] = []
    owner: dict[str, int] = {}  # request id -> replica

    def launch(new_rows: list[int]) -> dict[int, list[Seq]]:
        adds: dict[int, list[Seq]] = defaultdict(list)
        for row in new_rows:
            slot = len(rows)
            rows.append(row)
            targets = np.minimum(lengths.lengths(row, step, slot, plan.num_responses), max_new_tokens)
            for k, target in enumerate(targets.tolist()):
                rid = request_id(step, slot, k)
                replica = len(owner) % len(replicas)
                owner[rid] = replica
                adds[replica].append(Seq(rid, slot, k, lengths.prompt_tokens, target))
        return adds

    events: list[tuple[float, int, int]] = []
    aborted: list[Seq] = []

    def command(now: float, replica: Replica, abort: list[str], add: list[Seq]) -> None:
        aborted.extend(replica.command(now, abort, add))
        if replica.plan is None and replica.replan() is not None:
            heapq.heappush(events, (replica.next_event(), replica.index, replica.version))

    for i, seqs in launch(plan.prompts).items():
        command(0.0, replicas[i], [], seqs)
    outstanding = set(owner)
    completions: list[tuple[float, str]] = []
    trace = [(0.0, len(owner))]
    tokens_done = 0
    now = 0.0
    while True:
        if not events:
            raise RuntimeError(f"step {step}: {len(outstanding)} requests outstanding but no replica is running")
        now = events[0][0]
        due = set()
        while events and events[0][0] == now:
            _, i, version = heapq.heappop(events)
            if replicas[i].version == version and replicas[i].plan is not None:
                due.add(i)
        finished: list[Seq] = []
        for i in sorted(due):
            done_here, aborted_here = replicas[i].advance()
            finished += done_here
            aborted += aborted_here
        outstanding -= {s.id for s in finished}
        to_abort: dict[int, list[str]] = defaultdict(list)
        adds: dict[int, list[Seq]] = defaultdict(list)
        done = False
        for seq in finished:
            completions.append((now, seq.id))
            tokens_done += seq.length
            score = reward(rows[seq.slot], seq) if needs_rewards else None
            decision = policy.on_finished(seq.slot, seq.response, seq, score)
            for rid in decision.abort:
                if rid in outstanding:
                    to_abort[owner[rid]].append(rid)
            outstanding -= set(decision.abort)
            for i, seqs in launch(decision.launch).items():
                adds[i] += seqs
                outstanding |= {s.id for s in seqs}
            done |= decision.round_done
        if not outstanding and not adds:
            done = True  # nothing left to run: a policy that forgot to say so still ends its round
        if done:
            for replica in replicas:
                aborted += replica.abort_all(now)
            break
        for i in sorted(due | set(to_abort) | set(adds)):
            command(now, replicas[i], to_abort.get(i, []), adds.get(i, []))
        if due:
            trace.append((now, sum(r.num_requests() for r in replicas)))
    groups = policy.end_round(aborted)
    for g in groups:
        g.rewards = [reward(g.prompt, out) for out in g.outputs]
    return RoundRecord(
        kind=plan.kind, rollout_s=now, groups=groups, num_launched=len(owner), aborted=aborted,
        generated_tokens=tokens_done + sum(s.length for s in aborted),
        num_preemptions=sum(r.num_preemptions for r in replicas),
        bubble_ratio=bubble_ratio(trace, len(owner), now), completions=completions,
        busy=[r.busy for r in replicas] if replicas and replicas[0].busy is not None else None)


@dataclass
class StepResult:
    step: int
    kind: str
    rollout_s: float
    reward_s: float
    """Exposed reward time (scoring after rollout)."""
    train_s: float
    sync_s: float
    num_preemptions: int
    bubble_ratio: float
    max_length: int
    """Longest trained response."""
    trained_tokens: int
    wasted_tokens: int
    """Generated tokens not trained on (aborted, surplus, deferred)."""
    record: RoundRecord | None = None

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.reward_s + self.train_s + self.sync_s


def step_times(step: int, record: RoundRecord, cfg: SimConfig, cost: CostModel, *, keep: bool = False) -> StepResult:
    """The synchronous step around a round: rollout, then reward, train and weight sync."""
    kept = sorted(((g.prompt, out) for g in record.groups for out in g.outputs),
                  key=lambda kept: (kept[1].finish_time, kept[1].id))  # scored in completion order
    outputs = [out for _, out in kept]
    judge = CostModel(cost.hardware, MODELS[cfg.reward.judge_model], 1, cfg.calib)
    prompt = cfg.lengths.prompt_tokens
    samples = []
    for row, s in kept:
        task = cfg.reward.task(row)
        samples.append((task, cfg.reward.seconds(task, (step, s.slot, s.response), prompt, s.length, judge)))
    if cfg.reward_scheduler:
        code: dict[int, list[int]] = {}  # row -> indices of its code samples
        for i, (row, _) in enumerate(kept):
            if samples[i][0] == "code":
                code.setdefault(row, []).append(i)
        for mine in code.values():
            for i, t in zip(mine, adaptive_timeouts([samples[i][1] for i in mine], cfg.reward.code_timeout_s)):
                samples[i] = ("code", t)
        reward_s = cfg.reward.exposed_s([(t, sec, out.finish_time) for (t, sec), out in zip(samples, outputs)],
                                        record.rollout_s, cfg.gpus)
    else:
        reward_s = cfg.reward.stage_s(samples)
    seq_lens = np.array([prompt + s.length for s in outputs], dtype=np.float64)
    trained = int(sum(s.length for s in outputs))
    return StepResult(
        step=step, kind=record.kind, rollout_s=record.rollout_s, reward_s=reward_s,
        train_s=cost.train_s(seq_lens.sum(), (seq_lens**2).sum(), cfg.gpus), sync_s=cost.sync_s(),
        num_preemptions=record.num_preemptions, bubble_ratio=record.bubble_ratio,
        max_length=max((s.length for s in outputs), default=0), trained_tokens=trained,
        wasted_tokens=record.generated_tokens - trained, record=record if keep else None)


def simulate(cfg: SimConfig, *, record: bool = False) -> list[StepResult]:
    """``cfg.num_steps`` steps of ``cfg.policy``; ``record`` keeps each round's per-replica activity."""
    cost = cfg.cost()
    policy = cfg.build_policy()
    lengths = cfg.workload()
    results = []
    for step in range(cfg.num_steps):
        replicas = build_replicas(cost, cfg.num_replicas, max_num_seqs=cfg.max_num_seqs,
                                  max_prefill_tokens=cfg.max_prefill_tokens, record=record)
        rnd = simulate_round(step, policy, replicas, lengths, max_new_tokens=cfg.max_new_tokens,
                             reward=lambda row, seq: cfg.reward.value(row, seq.id))
        results.append(step_times(step, rnd, cfg, cost, keep=record))
    return results


def summarize(results: list[StepResult]) -> dict[str, dict[str, float]]:
    """Mean stage times per round kind and over all steps ('all')."""
    out = {}
    order = {"sync": 0, "short": 1, "long": 2}
    kinds = sorted({r.kind for r in results}, key=lambda k: (order.get(k, len(order)), k))
    for kind in [*kinds, "all"]:
        rs = [r for r in results if kind in ("all", r.kind)]
        out[kind] = {"steps": len(rs), **{k: float(np.mean([getattr(r, k) for r in rs])) for k in (
            "rollout_s", "reward_s", "train_s", "sync_s", "step_s", "num_preemptions", "bubble_ratio", "max_length")}}
    return out
