"""The simulated job: the job's round protocol on simulated replicas, and the step around it.

- :func:`simulate_round` is the round's second transport: it drives the same
  :class:`~rollpacker.schedule.round.Round` as the exchange, on simulated time. So a policy and
  the stream trainer's decider get the same calls in the same order.
- :func:`step_times` turns a round into an RL step's stages (rollout, exposed reward, training
  less what the freed GPUs trained, weight sync); :func:`simulate` runs a whole job.

Invariant: no decision is made here; what differs from the job is time, by design (scoring,
feeding and migration are instant, progress is exact). The design: ``docs/simulator.md``.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Literal

import numpy as np

from rollpacker.choices import check_choices
from rollpacker.data.dataset import PromptSampler
from rollpacker.data.lengths import LengthModel
from rollpacker.metrics import Phases, bubble_ratio
from rollpacker.plan.config import PlanConfig
from rollpacker.plan.planner import Planner, candidate_tps
from rollpacker.rollout.config import RolloutConfig
from rollpacker.schedule import config as policies
from rollpacker.schedule.base import Group, RoundPlan, refuse_with_pools
from rollpacker.schedule.drafts import DraftMemory
from rollpacker.schedule.round import Actions, Round, RoundOutcome, RoundState, Routing, Seen, opens_ahead
from rollpacker.schedule.runner import EpisodeRunner
from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig, StreamRound
from rollpacker.schedule.tail import TailConfig
from rollpacker.sim.cost import CRITIC_PASSES, HARDWARE, MODELS, TRAIN_PASSES, Calibration, CostModel
from rollpacker.sim.engine import Replica, Seq
from rollpacker.sim.episodes import EpisodeWorkload, ScriptedEpisode, ScriptedResponse, SimEnvPool
from rollpacker.sim.speculation import SpecSimConfig
from rollpacker.sim.workload import RewardModel, TraceLengths, adaptive_timeouts, read_length_trace
from rollpacker.topology import Topology


@dataclass(kw_only=True)
class SimConfig:
    model: Literal["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"] = "qwen2.5-14b"
    """Actor model: one of rollpacker.sim.cost.MODELS."""
    hardware: Literal["H800", "H100", "H200"] = "H800"
    """GPU kind: one of rollpacker.sim.cost.HARDWARE (the paper's cluster is H800)."""
    gpus: int = 32
    """GPUs of the job: rollout replicas of TP size rollout.tp, then all of them train (one_step_off: its pools)."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(num_prompts=128, max_new_tokens=16384, tp=2))
    """The run's rollout settings; the simulator reads P0, R0, max_new_tokens and tp (lengths cut at the cap)."""
    schedule: policies.ScheduleConfig = field(default_factory=TailConfig)
    """The run's scheduling policy and its settings (schedule:NAME; one_step_off's rollout_ranks are GPUs here)."""
    reward_scheduler: bool = False
    """§4.3: score each response as it finishes, adaptive code timeouts, judge on every GPU; else after rollout."""
    adaptive_timeouts: bool = True
    """reward_scheduler: cut code runs at §4.3's adaptive timeout; False keeps the fixed one (Fig. 13c's baseline)."""
    planner: bool = False
    """§4.2: the real parallelism planner picks each round's TP from its preemptions (a switch costs a weight sync)."""
    stream: bool = False
    """§4.4: the stream trainer frees half the replicas to train complete groups (needs reward_scheduler)."""
    critic: bool = False
    """PPO's critic trains beside the policy (train.advantage gae): 5 more forward passes' worth a trained token."""
    warm: bool = False
    """Episodes: the next round's first environments open as a round ends (``env.warm``), resetting while it trains."""
    stream_config: StreamConfig = field(default_factory=lambda: StreamConfig(criterion="kv"))
    """The stream trainer's trigger, fetch cap and KV projection quantile (its ``enabled`` also turns ``stream`` on);
    its criterion is the paper's KV fit: the throughput one learns from measured polls, which a simulation has not."""
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
    """Seeds the prompt order (and a trace's draws); ``lengths.seed`` and ``reward.seed`` seed the lengths, the
    rewards and their times."""
    lengths: LengthModel = field(default_factory=LengthModel)
    reward: RewardModel = field(default_factory=RewardModel)
    calib: Calibration = field(default_factory=Calibration)
    plan: PlanConfig = field(default_factory=PlanConfig)
    speculation: SpecSimConfig = field(default_factory=SpecSimConfig)
    """Speculative decoding on the replicas (rollpacker.sim.speculation)."""

    def __post_init__(self) -> None:
        check_choices(self, "sim")
        for name in ("gpus", "num_steps", "num_rows", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sim.{name} must be positive, got {getattr(self, name)}")
        topology = self.topology
        if topology.rollout_ranks % self.tp:
            raise ValueError(f"rollout.tp={self.tp} does not divide the {topology.rollout_ranks} GPUs rolling out")
        shape = MODELS.get(self.model)  # an unknown model: check_choices said so
        if shape and (shape.num_heads % self.tp or shape.num_kv_heads % self.tp):
            raise ValueError(f"rollout.tp={self.tp} does not divide {self.model}'s {shape.num_heads} attention heads "
                             f"and {shape.num_kv_heads} KV heads, as the job's engines need: pick a TP that does")
        topology.check("GPUs")
        self.stream = self.stream or self.stream_config.enabled
        if self.stream_config.criterion != "kv":
            raise ValueError("sim.stream_config.criterion throughput learns what a scale-down costs from the polls a "
                             "run measures, which a simulation has not: the simulator scales down on the paper's KV "
                             "fit (kv, its default here)")
        self.planner = self.planner or self.plan.enabled
        refuse_with_pools(self.schedule, stream=("sim.stream", self.stream), planner=("sim.planner", self.planner))
        if getattr(self.schedule, "pipe", False):
            raise ValueError("sim: schedule.pipe (RolloutPipe) is not simulated: its rollout on half the replicas "
                             "and the train pool beside it are not modelled. Drop schedule.pipe")
        if self.stream and self.critic:
            raise ValueError("sim.stream with sim.critic: GAE's advantages are whitened over the step's batch, so "
                             "stream training refuses train.advantage gae; drop one")
        if self.stream and not self.reward_scheduler:
            raise ValueError("sim.stream needs sim.reward_scheduler: the freed GPUs train each group once it is "
                             "scored, and without the reward scheduler nothing is scored before rollout ends")

    @property
    def policy(self) -> str:
        return self.schedule.name

    @property
    def tp(self) -> int:
        return self.rollout.tp

    @property
    def topology(self) -> Topology:
        """The job's GPUs: who rolls out (all, or a policy's own pool), who trains, the replicas."""
        s = self.schedule
        return Topology(self.gpus, tp=self.tp, rollout_ranks=s.rollout_pool(self.gpus) if s.own_pools else 0,
                        pools=s.own_pools)

    @property
    def rollout_pool(self) -> int:
        """GPUs rolling out: all of them, or the rollout pool of a policy with pools of its own."""
        return self.topology.rollout_ranks

    @property
    def train_pool(self) -> int:
        """GPUs training: all of them, or the ones a policy with pools of its own does not roll out on."""
        return len(self.topology.train)

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    def cost(self) -> CostModel:
        return CostModel(HARDWARE[self.hardware], MODELS[self.model], self.tp, self.calib,
                         train_passes=TRAIN_PASSES + CRITIC_PASSES * self.critic)

    def workload(self):
        if not self.trace:
            return self.lengths.for_cap(self.rollout.max_new_tokens)
        groups = read_length_trace(self.trace, self.rollout.group_size)
        return TraceLengths(tuple(map(tuple, groups)), self.lengths.prompt_tokens, self.seed)

    def build_policy(self):
        """The policy, built as the run builds it (the last step is the run's last)."""
        return self.schedule.build(PromptSampler(self.num_rows, seed=self.seed), self.rollout.num_prompts,
                                   self.rollout.group_size, last_step=self.num_steps - 1)


@dataclass
class RoundRecord:
    kind: str
    rollout_s: float
    groups: list[Group]
    num_launched: int
    aborted: list[Seq]
    generated_tokens: int
    """Tokens generated in the round, kept or thrown away."""
    wasted_tokens: int
    """Of those and the carried ones, the tokens neither trained nor held for later (``RoundOutcome.wasted_tokens``)."""
    num_preemptions: int
    num_session_evictions: int
    """Resident sessions evicted for KV (their next turns prefill everything again)."""
    bubble_ratio: float
    completions: list[tuple[float, str]]
    """(time, request id) of every finished response, in the order the policy was told."""
    busy: list[list[tuple[float, float, int]]] | None = None
    """Per replica: (start, end, running requests) of its activity, when recorded."""
    scaled_at: float | None = None
    """Stream trainer: when rollout scaled down to the kept replicas (None: it did not)."""
    scaled_frac: float = 0.0
    """Fraction of the round's prompts complete at the scale-down."""
    num_freed: int = 0
    """Replicas the scale-down freed (their GPUs train)."""
    streamed: list[tuple[float, Group]] = field(default_factory=list)
    """(time it was fed, group) of every group fed to the freed GPUs, in feed order."""
    phases: Phases = field(default_factory=Phases)
    """Where the round's polls spent their seconds (lockstep polling only)."""


@dataclass(frozen=True)
class Polling:
    """Lockstep polling as the controller's exchange loop does it: every replica runs ``steps``
    iterations (``rollout.poll_steps``), then an exchange of ``exchange_s`` plus ``request_s`` for each
    request added or finished in the poll (the profile's ``exchange_ms`` and ``exchange_request_ms``)."""

    steps: int
    exchange_s: float
    request_s: float = 0.0

    def exchange(self, requests: int) -> float:
        return self.exchange_s + self.request_s * requests


def build_replicas(cost: CostModel, num_replicas: int, *, max_num_seqs: int = 1024, max_prefill_tokens: int = 16384,
                   record: bool = False) -> list[Replica]:
    capacity = cost.kv_capacity_tokens()
    return [Replica(i, cost, capacity, max_num_seqs, max_prefill_tokens, record=record) for i in range(num_replicas)]


def simulate_round(step: int, policy, replicas: list[Replica], lengths, *, max_new_tokens: int,
                   reward=lambda row, seq: None, plan: RoundPlan | None = None,
                   stream: ScaleDownDecider | None = None, poll: Polling | None = None,
                   env: SimEnvPool | None = None, routing: Routing = Routing(),
                   memory: DraftMemory | None = None) -> RoundRecord:
    """One round of ``policy`` on fresh ``replicas`` (time starts at 0): the job's round protocol
    (:class:`~rollpacker.schedule.round.Round`) on simulated time.

    ``lengths.lengths(row, step, slot, n)`` gives the natural lengths of a launch (cut at
    ``max_new_tokens``), ``lengths.prompt_tokens`` the prompt size; ``reward(row, seq)`` the reward
    of a response (scored at once); ``plan``, the round when the caller already asked the policy for
    it; ``stream``, the stream trainer's decider. ``poll`` runs the replicas in lockstep as the
    controller's exchange loop does (:class:`Polling`), instead of polling at each replica event;
    ``routing``, the job's (``rollout.routing``, ``rollout.longest_first``, which orders launches by the lengths
    ``memory`` kept of earlier rounds: the run's, as the controller's).

    ``env``: the run's environment workers, carried from the last round (:meth:`SimEnvPool.shift`). With
    a workload, each response is an episode of it (:mod:`rollpacker.sim.episodes`): its turns on the
    replicas (``lengths.turn_length``, each cut at ``max_new_tokens``), its environment calls on the
    pool's workers. Without, each response is one turn of its launch's length."""
    if poll and stream:
        raise ValueError("simulate_round: lockstep polling is not simulated with a stream trainer")
    plan = plan or policy.start_round(step)
    sim: _SimRound | None = None

    def clock() -> float:
        return sim.now

    env = env or SimEnvPool()
    make = ScriptedResponse.maker(lengths, plan.num_responses, max_new_tokens, clock)
    if (work := env.workload) is not None:

        def make(key: str, row: int, reset) -> ScriptedEpisode:
            return ScriptedEpisode(key, row, reset, lengths=lengths, prompt_tokens=lengths.prompt_tokens,
                                   obs_tokens=work.obs_tokens, max_new_tokens=max_new_tokens,
                                   max_tokens=work.max_tokens, clock=clock, resident=work.resident)
    runner = EpisodeRunner(make, seed=env.seed, environment=work is not None)
    rnd = Round(RoundState(step, plan, policy, len(replicas), routing=routing, memory=memory), _Instant(reward), runner,
                StreamRound(stream) if stream else None)
    sim = _SimRound(step, plan, rnd, replicas, poll, env)
    return sim.run()


def job_routing(rollout: RolloutConfig) -> tuple[Routing, DraftMemory | None]:
    """The job's routing of ``rollout``'s settings, and the run's memory of lengths it orders by (longest first)."""
    routing = Routing(by_group=rollout.routing == "group", longest_first=rollout.longest_first)
    return routing, DraftMemory(keep_tokens=False) if rollout.longest_first else None


@dataclass
class _Instant:
    """The simulator's scorer: every response scored the moment it is submitted."""

    reward: Callable[[int, Seq], float | None]
    done: list[tuple[str, float | None]] = field(default_factory=list)

    def submit(self, key: str, row: int, output: Seq) -> None:
        self.done.append((key, self.reward(row, output)))

    def submit_group(self, keys: list[str], row: int, outputs: list[Seq]) -> None:
        """Nothing: a simulated response's reward is whole when it is submitted."""

    def poll(self) -> list[tuple[str, float | None]]:
        done, self.done = self.done, []
        return done

    def wait(self, keys: list[str]) -> list[tuple[str, float | None]]:
        return self.poll()


@dataclass
class _SimRound:
    """:func:`simulate_round`'s transport: the simulated requests, replicas and environment workers,
    and what the round records."""

    step: int
    plan: RoundPlan
    round: Round
    replicas: list[Replica]
    poll: Polling | None
    env: SimEnvPool
    seqs: dict[str, Seq] = field(default_factory=dict)
    events: list[tuple[float, int, int]] = field(default_factory=list)
    """(end of a replica's planned run, replica, its plan's version): event-driven mode's queue."""
    aborted: list[Seq] = field(default_factory=list)
    """Requests the replicas aborted since the last poll."""
    completions: list[tuple[float, str]] = field(default_factory=list)
    trace: list[tuple[float, int]] = field(default_factory=list)
    fed: list[tuple[float, Group]] = field(default_factory=list)
    phases: Phases = field(default_factory=Phases)
    now: float = 0.0
    sent: int = 0
    """Requests added (and resumed) by the last command: the next poll's exchange carries them."""

    def run(self) -> RoundRecord:
        self.apply(self.round.start(0.0), set())
        self.trace.append((0.0, self.round.state.num_launched))
        while True:
            finished, due = self.advance()
            seen = Seen(now=self.now, finished=finished, aborted=self.take_aborted(), env=self.env.take(self.now))
            actions = self.round.poll(seen, self.generated)
            if actions.scale_down:
                self.migrate(actions)  # what migrates may come back whole and end the round
            if actions.done:
                self.fed += [(self.now, g) for g in actions.feed]
                final_s = self.poll.exchange(0) if self.poll else 0.0  # the final command (its aborts), the reports
                self.now += final_s
                self.phases.add(final_s, [])
                final = self.take_aborted() + [seq for replica in self.replicas for seq in replica.abort_all(self.now)]
                self.round.end(final)
                self.round.settle()  # the instant scorer has every score
                outcome = self.round.finish()
                self.env.send(actions.env + outcome.env, self.now)  # the closes of the last episodes done and cut
                return self.record(outcome)
            self.apply(actions, due)
            if due:
                self.trace.append((self.now, sum(r.num_requests() for r in self.replicas)))

    def apply(self, actions: Actions, due: set[int]) -> None:
        """Send the requests, resumes and aborts to the active replicas (and a command to those due one)."""
        state = self.round.state
        adds: dict[int, list[Seq]] = defaultdict(list)
        self.sent = len(actions.add) + len(actions.resume)
        for replica, priority, turn in actions.add:
            adds[replica].append(self.request(turn, priority))
        for replica, seq in actions.resume:  # prefilled again with its prompt and generated tokens
            adds[replica].append(seq)
        for replica, key in actions.end_sessions:
            self.replicas[replica].end_session(key)
        self.env.send(actions.env, self.now)
        to_abort: dict[int, list[str]] = defaultdict(list)
        for replica, rid in actions.abort:
            to_abort[replica].append(rid)
        self.fed += [(self.now, g) for g in actions.feed]
        for i in sorted(i for i in due | set(to_abort) | set(adds) if i < state.active):
            self.send(i, to_abort.get(i, []), adds.get(i, []))

    def migrate(self, actions: Actions) -> None:
        """Rollout scaled down: the freed replicas abort everything at once, and the round resumes
        what migrates in this same instant (added to ``actions``, less the aborts the freed replicas did)."""
        state = self.round.state
        actions.abort = [(replica, rid) for replica, rid in actions.abort if replica < state.active]
        leaving = [seq for replica in self.replicas[state.active:]  # in replica order, each sorted, as reported
                   for seq in sorted(replica.abort_all(self.now), key=lambda s: s.id)]
        back = self.round.poll(Seen(now=self.now, aborted=leaving), self.generated)
        actions.add += back.add
        actions.resume += back.resume
        actions.abort += back.abort
        actions.env += back.env
        actions.end_sessions += back.end_sessions
        actions.feed += back.feed
        actions.done |= back.done

    def request(self, turn, priority: int) -> Seq:
        """The simulated request of a turn: its prompt the conversation so far, its length its budget (a
        resumed partial goes on toward its own length), its admission ``priority`` the round's; its session's
        KV is its replica's to reuse."""
        _, slot, k = (int(x) for x in EpisodeRunner.key(turn.id).split(":"))
        partial = turn.resume_from
        target, generated = (partial.target, partial.generated) if partial is not None else (turn.max_new_tokens, 0)
        self.seqs[turn.id] = seq = Seq(turn.id, slot, k, len(turn.prompt_ids), target, generated=generated,
                                       session=turn.session, priority=priority)
        return seq

    def send(self, i: int, abort: list[str], add: list[Seq]) -> None:
        """Replica ``i`` gets aborts and requests now (event-driven: its next run is queued)."""
        replica = self.replicas[i]
        self.aborted.extend(replica.command(self.now, abort, add))
        if not self.poll and replica.plan is None and replica.replan() is not None:
            heapq.heappush(self.events, (replica.next_event(), replica.index, replica.version))

    def take_aborted(self) -> list[Seq]:
        aborted, self.aborted = self.aborted, []
        return aborted

    def advance(self) -> tuple[list[Seq], set[int]]:
        """To the next poll's exchange (lockstep) or the next replica event. Returns the responses
        finished by then and the replicas due a command."""
        finished: list[Seq] = []
        active, due = self.round.state.active, set()
        waiting = self.env.next_reply()
        running = any(r.num_requests() for r in self.replicas[:active])
        if self.poll and waiting is not None and not running:  # only environments work: polled until one replies
            before, self.now = self.now, max(self.now, waiting) + self.poll.exchange(self.sent)
            self.phases.add(self.now - before, [])
        elif self.poll:
            end, engines = _poll(self.replicas[:active], self.now, self.poll.steps, finished, self.aborted)
            end += self.poll.exchange(self.sent + len(finished))
            self.phases.add(end - self.now, engines)
            self.now = end
            due = set(range(active))
            if not finished and not any(r.num_requests() for r in self.replicas) and waiting is None:
                self._stalled()
        elif self.events and (waiting is None or self.events[0][0] <= waiting):
            self.now, due = _next_event(self.events, self.replicas, finished, self.aborted)
        elif waiting is not None:
            self.now = waiting
        else:
            self._stalled()
        self.completions += [(self.now, seq.id) for seq in finished]
        return finished, due

    def _stalled(self) -> None:
        raise RuntimeError(f"step {self.step}: {len(self.round.state.outstanding)} requests outstanding but no "
                           "replica is running")

    def generated(self) -> list[tuple[int, int]]:
        """(prompt tokens, tokens generated) of each running turn, exactly."""
        seqs = self.seqs
        return [(seqs[rid].prompt_tokens, self.replicas[replica].generated_at(seqs[rid], self.now))
                for replica, rid in self.round.running()]

    def record(self, outcome: RoundOutcome) -> RoundRecord:
        replicas, scaled = self.replicas, outcome.scaled
        return RoundRecord(
            kind=self.plan.kind, rollout_s=self.now, groups=outcome.groups, num_launched=outcome.num_launched,
            aborted=outcome.aborted, generated_tokens=outcome.generated_tokens, wasted_tokens=outcome.wasted_tokens,
            num_preemptions=sum(r.num_preemptions for r in replicas),
            num_session_evictions=sum(r.num_session_evictions for r in replicas),
            bubble_ratio=bubble_ratio(self.trace, outcome.num_launched, self.now), completions=self.completions,
            busy=[r.busy for r in replicas] if replicas and replicas[0].busy is not None else None,
            scaled_at=scaled.at if scaled else None, scaled_frac=(scaled.completed_frac or 0.0) if scaled else 0.0,
            num_freed=len(replicas) - self.round.state.active, streamed=self.fed, phases=self.phases)


def _next_event(events: list[tuple[float, int, int]], replicas: list[Replica], finished: list[Seq],
                aborted: list[Seq]) -> tuple[float, set[int]]:
    """The replicas whose planned runs end first advance to that instant (adding to ``finished``
    and ``aborted``); returns it and their indices."""
    now, due = events[0][0], set()
    while events and events[0][0] == now:
        _, i, version = heapq.heappop(events)
        if replicas[i].version == version and replicas[i].plan is not None:
            due.add(i)
    for i in sorted(due):
        done_here, aborted_here = replicas[i].advance()
        finished += done_here
        aborted += aborted_here
    return now, due


def _poll(replicas: list[Replica], now: float, steps: int, finished: list[Seq],
          aborted: list[Seq]) -> tuple[float, list[tuple[float, float]]]:
    """Every replica runs ``steps`` iterations from ``now`` (adding to ``finished`` and ``aborted``).
    Returns when the last is done, and each one's (prefill, decode) seconds."""
    engines = []
    for replica in replicas:
        before = replica.prefill_s, replica.decode_s
        done_here, aborted_here = replica.run_steps(now, steps)
        finished += done_here
        aborted += aborted_here
        engines.append((replica.prefill_s - before[0], replica.decode_s - before[1]))
    return max(r.clock for r in replicas), engines


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
    tp: int
    """Rollout TP of the round."""
    trained_tokens: int
    wasted_tokens: int
    """Generated tokens neither trained nor held for a later round (aborted, surplus, deferred, filtered)."""
    scaled_down: bool = False
    """The stream trainer scaled rollout down in this round."""
    scaled_frac: float = 0.0
    """Fraction of the round's prompts complete at the scale-down."""
    hidden_train_s: float = 0.0
    """Seconds taken off the train stage: training the freed GPUs finished before rollout ended, over all GPUs."""
    wait_s: float | None = None
    """one_step_off: the training GPUs' wait for this step's batch, whose rollout and reward ran under the
    previous step's training (``time/wait_prev_gen``); the step is this wait, training and the weight sync."""
    record: RoundRecord | None = None

    @property
    def step_s(self) -> float:
        if self.wait_s is not None:
            return self.wait_s + self.train_s + self.sync_s
        return self.rollout_s + self.reward_s + self.train_s + self.sync_s


def step_times(step: int, record: RoundRecord, cfg: SimConfig, cost: CostModel, *, keep: bool = False) -> StepResult:
    """The synchronous step around a round: rollout, then reward, train (less what the freed GPUs
    trained under the rollout, with a stream trainer) and weight sync."""
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
        code: dict[int, list[int]] = {}  # row -> indices of its code samples, to cut at the adaptive timeout
        for i, (row, _) in enumerate(kept if cfg.adaptive_timeouts else []):
            if samples[i][0] == "code":
                code.setdefault(row, []).append(i)
        for mine in code.values():
            for i, t in zip(mine, adaptive_timeouts([samples[i][1] for i in mine], cfg.reward.code_timeout_s)):
                samples[i] = ("code", t)
        reward_s = cfg.reward.exposed_s([(t, sec, out.finish_time) for (t, sec), out in zip(samples, outputs)],
                                        record.rollout_s, cfg.rollout_pool)
    else:
        reward_s = cfg.reward.stage_s(samples)
    seq_lens = np.array([prompt + s.length for s in outputs], dtype=np.float64)
    trained = int(sum(s.length for s in outputs))
    hidden = streamed_gpu_s(record, cost, prompt)
    train_s = ((cost.train_gpu_s(seq_lens.sum(), (seq_lens**2).sum()) - hidden) / cfg.train_pool
               + cost.calib.train_overhead_s)
    return StepResult(
        step=step, kind=record.kind, rollout_s=record.rollout_s, reward_s=reward_s, train_s=train_s,
        sync_s=cost.sync_s(), num_preemptions=record.num_preemptions, bubble_ratio=record.bubble_ratio, tp=cost.tp,
        max_length=max((s.length for s in outputs), default=0), trained_tokens=trained,
        wasted_tokens=record.wasted_tokens, scaled_down=record.scaled_at is not None,
        scaled_frac=record.scaled_frac, hidden_train_s=hidden / cfg.train_pool, record=record if keep else None)


def streamed_gpu_s(record: RoundRecord, cost: CostModel, prompt_tokens: int) -> float:
    """GPU-seconds of training the freed GPUs finish before rollout ends (0 without a scale-down).

    They are one fluid server: the fed groups in feed order, each started when both it is fed and
    the one before is done, its work (:meth:`CostModel.train_gpu_s`) spread over all freed GPUs. What
    is left at rollout end is trained with the rest on every GPU (the paper's redistribution)."""
    if record.scaled_at is None:
        return 0.0
    gpus = record.num_freed * cost.tp
    trained = {id(g) for g in record.groups}
    clock, done = record.scaled_at, 0.0
    for fed, group in record.streamed:
        if id(group) not in trained:
            continue
        lens = np.array([prompt_tokens + out.length for out in group.outputs], dtype=np.float64)
        work = cost.train_gpu_s(lens.sum(), (lens**2).sum())
        start = max(clock, fed)
        if start >= record.rollout_s:
            break
        done += min(work, (record.rollout_s - start) * gpus)
        clock = start + work / gpus
    return done


def simulate(cfg: SimConfig, *, record: bool = False, env_workload: EpisodeWorkload | None = None) -> list[StepResult]:
    """``cfg.num_steps`` steps of ``cfg.policy``; ``record`` keeps each round's per-replica activity;
    ``env_workload``: each response an episode of that workload (its environment's reward comes with it:
    no reward stage)."""
    base = cfg.cost()
    cfg = replace(cfg, schedule=replace(cfg.schedule))  # settled on a copy: the caller's config stays as given
    cfg.schedule.settle(episodes=env_workload is not None)  # the policy as the job builds it
    policy = cfg.build_policy()
    lengths = cfg.workload()
    planner = None
    if cfg.planner:
        longest = cfg.lengths.prompt_tokens + cfg.rollout.max_new_tokens  # a TP whose KV cannot hold one request is out
        candidates = [t for t in candidate_tps(cfg.gpus, base.model.num_kv_heads,
                                               cfg.plan.max_tp or base.hardware.gpus_per_node)
                      if replace(base, tp=t).kv_capacity_tokens() >= longest]
        initial = cfg.plan.initial_tp or cfg.tp
        if initial not in candidates:  # the planner's own message names a run's profile and plan.initial_tp alone
            raise ValueError(f"{'plan.initial_tp' if cfg.plan.initial_tp else 'rollout.tp'}={initial}: the planner "
                             f"can run {candidates} here (TPs dividing the GPUs and the KV heads, within a node and "
                             f"plan.max_tp, whose KV cache holds a request of {longest} tokens): start at one of them")
        planner = Planner(cfg.plan, candidates, initial)
    results, tp, decider = [], planner.initial if planner else cfg.tp, None
    routing, memory = job_routing(cfg.rollout)
    env = SimEnvPool(env_workload, seed=cfg.seed)
    drafts = cfg.speculation.drafts()
    for step in range(cfg.num_steps):
        if cfg.schedule.own_pools:  # batch k is generated while batch k-1 trains, with the weights before it
            policy.weights_step = max(step - 1, 0)
        plan = policy.start_round(step)
        switched = planner is not None and planner.tp_for(plan.kind) != tp
        tp = planner.tp_for(plan.kind) if planner else tp
        cost = replace(base, tp=tp)
        replicas = build_replicas(cfg.speculation.cost(cost, drafts[step % len(drafts)]), cfg.rollout_pool // tp,
                                  max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens,
                                  record=record)
        if cfg.stream and (decider is None or switched):  # as StreamTrainer.rebuild: the histories carry over
            histories = decider.histories if decider else {}
            decider = ScaleDownDecider(cfg.stream_config, num_replicas=len(replicas),
                                max_new_tokens=cfg.rollout.max_new_tokens,
                                kv_capacity_tokens=cost.kv_capacity_tokens())
            decider.histories = histories
        rnd = simulate_round(step, policy, replicas, lengths, max_new_tokens=cfg.rollout.max_new_tokens,
                             reward=lambda row, seq: cfg.reward.value(row, seq.id), plan=plan, stream=decider, env=env,
                             routing=routing, memory=memory)
        result = step_times(step, rnd, cfg, cost, keep=record)
        if env_workload:  # an episode's reward comes with it, from its environment: no reward stage
            result.reward_s = 0.0
        if cfg.warm and env_workload and step + 1 < cfg.num_steps:  # env.warm: as this round ends
            env.warm(opens_ahead(policy, step + 1, cfg.seed), result.rollout_s)
        if switched:  # the engines are rebuilt on the new TP and loaded from the trainer: one more weight push
            result.sync_s += cost.sync_s()
        if planner:
            planner.observe(plan.kind, rnd.num_preemptions)
        last_train_s = results[-1].train_s if results else 0.0
        if cfg.schedule.own_pools:  # generated and scored from the last boundary, while the last batch trained
            result.wait_s = max(0.0, result.rollout_s + result.reward_s - last_train_s)
        # what its workers still run goes on into the next round, which one_step_off starts as this batch trains
        env.shift(result.step_s + (last_train_s - result.train_s if cfg.schedule.own_pools else 0.0))
        results.append(result)
    return results


def summarize(results: list[StepResult]) -> dict[str, dict[str, float]]:
    """Mean stage times per round kind and over all steps ('all')."""
    out = {}
    order = {"sync": 0, "short": 1, "long": 2}
    kinds = sorted({r.kind for r in results}, key=lambda k: (order.get(k, len(order)), k))
    for kind in [*kinds, "all"]:
        rs = [r for r in results if kind in ("all", r.kind)]
        out[kind] = {"steps": len(rs), **{k: float(np.mean([getattr(r, k) for r in rs])) for k in (
            "rollout_s", "reward_s", "train_s", "sync_s", "step_s", "num_preemptions", "bubble_ratio", "max_length",
            "scaled_down", "hidden_train_s")}}
        out[kind]["wait_s"] = float(np.mean([r.wait_s or 0.0 for r in rs]))  # one_step_off
        scaled = [r.scaled_frac for r in rs if r.scaled_down]
        out[kind]["scaled_frac"] = float(np.mean(scaled)) if scaled else 0.0
    return out


PAPER_GPUS = {"qwen2.5-7b": 16, "qwen2.5-14b": 32, "qwen2.5-32b": 64}
"""GPUs of the paper's §6 runs, per model: the default of --gpus."""


def preset_config(name: str, model: str | None = None):
    """A :class:`SimConfig` from a repo preset or a .toml of one's own: its P0, R0, max_new_tokens, TP, and
    ``model`` (default: the one its name starts with)."""
    from rollpacker.config import load_preset

    try:
        rollout = load_preset(name).rollout  # first: a preset that is not there says so
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--preset: {e}") from None
    stem = name.rsplit("/", 1)[-1].removesuffix(".toml")
    model = model or max((m for m in MODELS if stem.startswith(m)), key=len, default=None)
    if model not in MODELS:
        raise SystemExit(f"preset {name!r} names no known model ({', '.join(MODELS)}): pass --model NAME"
                         if model is None else f"--model {model!r}: not a known model ({', '.join(MODELS)})")
    return SimConfig(model=model, gpus=PAPER_GPUS[model], rollout=rollout)
