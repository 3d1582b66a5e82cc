"""One simulated engine replica: continuous batching over a KV cache, preemption by recompute.

The replica behaves like vLLM or TorchEngine at iteration granularity. At each iteration boundary
commands apply, the newest request of the worst priority is preempted if the KV cannot grow, else
waiting requests are admitted, lowest priority first; then every running request advances one
token, at :meth:`CostModel.iteration_times`.

Invariants:

- An aborted request never finishes afterwards.
- A run of identical iterations is planned at once (the replica's *plan*). A command that arrives
  mid-plan cuts it at the next iteration boundary.
- KV is counted in tokens, not blocks; prefill is not chunked.
- A resident session's KV counts against the cache until its next turn takes it over; sessions are
  evicted, least recently kept first, before any running request is preempted (as TorchEngine).

Why plans: the simulator visits only the iterations where something changes, not every one.
The boundary step by step: ``docs/simulator.md`` (A replica).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class Seq:
    """A request on a replica."""

    id: str
    slot: int
    response: int
    prompt_tokens: int
    target: int
    """Tokens it will generate (its length, already cut at max_new_tokens)."""
    generated: int = 0
    """Tokens generated when it was last admitted (or preempted, or aborted)."""
    admitted_at: int = -1
    """The replica's iteration count when it was last admitted."""
    admit_seq: int = -1
    """Admission order, for ties and preemption."""
    finish_time: float | None = None
    num_preemptions: int = 0
    num_turns: int = 0
    """An episode's output: its model turns."""
    session: str | None = None
    """Its episode, when its replica keeps its KV for the episode's next turn (a resident session): a turn
    whose session is still resident prefills only what is new; a preempted or migrated one recomputes all."""
    priority: int = 0
    """Admission order, lower first, as ``Request.priority`` (the frontier's: the round's turn priority)."""

    @property
    def length(self) -> int:
        """Tokens generated, once it has left its replica (finished or aborted)."""
        return self.generated

    # What a policy and the round read of an engine output (sorted_partial keeps partial ones across rounds).
    @property
    def token_ids(self) -> range:
        return range(self.generated)

    @property
    def num_model_tokens(self) -> int:
        return self.generated

    @property
    def logprobs(self) -> tuple:
        return ()

    @property
    def prompt_ids(self) -> range:
        return range(self.prompt_tokens)

    @property
    def finish_reason(self) -> str:
        return "abort" if self.finish_time is None else "stop"


class Replica:
    def __init__(self, index: int, cost, kv_capacity: int, max_num_seqs: int = 1024,
                 max_prefill_tokens: int = 16384, watermark: float = 0.01, record: bool = False):
        if kv_capacity <= 0:
            raise ValueError(f"replica {index}: no KV cache left after the weights (kv_capacity={kv_capacity}); "
                             "use a larger TP size or a GPU with more memory")
        self.index, self.cost, self.kv_capacity = index, cost, kv_capacity
        self.max_num_seqs, self.max_prefill_tokens, self.watermark = max_num_seqs, max_prefill_tokens, watermark
        self.clock = 0.0
        self.iters = 0
        self.running: dict[str, Seq] = {}  # in admission order
        self.waiting: deque[Seq] = deque()
        self._finishes: list[tuple[int, int, str]] = []  # (finish iteration, admit_seq, id)
        self._ctx_base = 0  # sum over running of prompt + generated - admitted_at
        self._admit_count = 0
        self._pending_abort: list[str] = []
        self._pending_add: list[Seq] = []
        self.plan: tuple[float, np.ndarray, int] | None = None
        """(start time, iteration end times, running requests) of the planned run, or None at a boundary."""
        self.version = 0
        self.num_preemptions = self.num_session_evictions = 0
        self.sessions: dict[str, int] = {}
        """Session -> tokens of its last finished turn (prompt and generated): its resident KV here, least
        recently kept first."""
        self.held = 0
        """Tokens of KV the resident sessions hold."""
        self.busy: list[tuple[float, float, int]] | None = [] if record else None
        """(start, end, running requests) of every executed run, when recording."""
        self.prefill_s = self.decode_s = 0.0
        """Seconds of executed iterations that prefilled a request, and of the others (as the job's
        :class:`~rollpacker.metrics.Phases` counts them)."""
        self._prefills = False
        """The planned run's first iteration prefills."""

    # -- state -----------------------------------------------------------------------------------

    def kv_used(self) -> int:
        return self._ctx_base + len(self.running) * self.iters

    def generated(self, seq: Seq) -> int:
        return seq.generated + self.iters - seq.admitted_at if seq.id in self.running else seq.generated

    def generated_at(self, seq: Seq, now: float) -> int:
        """Tokens ``seq`` has generated by ``now``: the iterations of the planned run over by then count."""
        if seq.id not in self.running or self.plan is None:
            return self.generated(seq)
        return self.generated(seq) + int(np.searchsorted(self.plan[1], now, side="right"))

    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self._pending_add)

    def next_event(self) -> float | None:
        return None if self.plan is None else float(self.plan[1][-1])

    # -- the controller's side -------------------------------------------------------------------

    def command(self, now: float, abort: list[str], add: list[Seq]) -> list[Seq]:
        """Aborts and new requests sent at ``now``; they apply at the next iteration boundary
        (at once when the replica is at one); a request of a session resident here prefills only what is new.
        Returns the aborted requests that were here."""
        self._pending_abort += abort
        self._pending_add += add
        if self.plan is None:
            self.clock = max(self.clock, now)
            return self._apply_aborts()
        start, ends, _ = self.plan
        begun = int(np.searchsorted(ends, now, side="left")) + (start < now)  # iterations started before now
        if begun > len(ends) - 1:
            return []  # the plan's last iteration is under way: the commands wait for its end
        finished, aborted = self._execute(begun)
        assert not finished, "a cut plan ends before its first finish"
        return aborted

    def end_session(self, session: str) -> None:
        """The session's episode is over: its resident KV goes."""
        self.held -= self.sessions.pop(session, 0)

    def _make_room(self, tokens: int, spare: set[str | None] = frozenset()) -> bool:
        """Evict resident sessions not in ``spare``, least recently kept first, until ``tokens`` more fit
        the cache; whether they do."""
        while self.kv_used() + self.held + tokens > self.kv_capacity:
            session = next((s for s in self.sessions if s not in spare), None)
            if session is None:
                return False
            self.held -= self.sessions.pop(session)
            self.num_session_evictions += 1
        return True

    def _queued_sessions(self) -> set[str | None]:
        """The sessions of the waiting requests, whose resident KV is about to be reused."""
        return {s.session for s in self.waiting} if self.sessions else set()

    def abort_all(self, now: float) -> list[Seq]:
        """End of round (or a stream-trainer scale-down) at ``now``: every request leaves; returns
        them with their tokens so far (``generated``, which a later admission elsewhere prefills again)."""
        aborted = []
        if self.plan is not None:  # iterations over by now happened; the one under way is cut short
            finished, aborted = self._execute(int(np.searchsorted(self.plan[1], now, side="right")))
            assert not finished, "a plan ending now would have been advanced"
        seqs = [*aborted, *self.running.values(), *self.waiting, *self._pending_add]
        for s in seqs:
            s.generated = self.generated(s)
        self.running.clear()
        self.waiting.clear()
        self._pending_add, self._pending_abort = [], []
        return seqs

    def run_steps(self, now: float, num_iters: int) -> tuple[list[Seq], list[Seq]]:
        """Lockstep polling (the controller's ``rollout.poll_steps``): from ``now``, up to
        ``num_iters`` iterations (fewer once nothing runs); returns (finished, aborted) and leaves
        ``clock`` at the end of the last one."""
        assert self.plan is None, "polled replicas run no plan between polls"
        self.clock = now
        finished, aborted = [], self._apply_aborts()
        end = self.iters + num_iters
        while self.iters < end and self.replan() is not None:
            now_finished, now_aborted = self._execute(min(len(self.plan[1]), end - self.iters))
            finished += now_finished
            aborted += now_aborted
        return finished, aborted

    # -- the replica's side ----------------------------------------------------------------------

    def advance(self) -> tuple[list[Seq], list[Seq]]:
        """Run the planned iterations to their end: (finished, aborted at this boundary)."""
        _, ends, _ = self.plan
        return self._execute(len(ends))

    def _execute(self, num_iters: int) -> tuple[list[Seq], list[Seq]]:
        start, ends, batch = self.plan
        end = float(ends[num_iters - 1]) if num_iters else start
        if num_iters and self.busy is not None:
            self.busy.append((start, end, batch))
        first = float(ends[0]) if num_iters and self._prefills else start
        self.prefill_s, self.decode_s = self.prefill_s + first - start, self.decode_s + end - first
        self.iters += num_iters
        self.clock = end
        self.plan = None
        self.version += 1
        aborted = self._apply_aborts()
        finished = []
        while self._finishes and self._finishes[0][0] <= self.iters:
            at, admit_seq, rid = heapq.heappop(self._finishes)
            seq = self.running.get(rid)
            if seq is None or seq.admit_seq != admit_seq:
                continue  # preempted or aborted since
            self._remove(seq)
            seq.finish_time = end
            if seq.session is not None:
                self.held -= self.sessions.pop(seq.session, 0)
                self.sessions[seq.session] = seq.prompt_tokens + seq.generated
                self.held += self.sessions[seq.session]
            finished.append(seq)
        return finished, aborted

    def _apply_aborts(self) -> list[Seq]:
        aborted = []
        for rid in self._pending_abort:
            seq = self.running.get(rid)
            if seq is not None:
                self._remove(seq)
            else:
                seq = next((s for s in (*self.waiting, *self._pending_add) if s.id == rid), None)
                if seq is None:
                    continue
                (self.waiting if seq in self.waiting else self._pending_add).remove(seq)
            aborted.append(seq)
        self._pending_abort = []
        return aborted

    def _remove(self, seq: Seq) -> None:
        seq.generated = self.generated(seq)
        del self.running[seq.id]
        self._ctx_base -= seq.prompt_tokens + seq.generated - self.iters

    def _enqueue(self, seq: Seq, *, ahead: bool = False) -> None:
        """Queue ``seq`` by priority (lower first): after its equals, or ``ahead`` of them (preempted), as
        TorchEngine does."""
        p, i = seq.priority, len(self.waiting)
        while i and (self.waiting[i - 1].priority > p or ahead and self.waiting[i - 1].priority == p):
            i -= 1
        self.waiting.insert(i, seq)

    def _admit(self, seq: Seq) -> None:
        """``seq`` runs; it takes over its session's resident KV, if any."""
        self.held -= self.sessions.pop(seq.session, 0)
        seq.admitted_at, seq.admit_seq = self.iters, self._admit_count
        self._admit_count += 1
        self.running[seq.id] = seq
        self._ctx_base += seq.prompt_tokens + seq.generated - self.iters
        heapq.heappush(self._finishes, (self.iters + seq.target - seq.generated, seq.admit_seq, seq.id))

    def replan(self) -> float | None:
        """At a boundary: preempt or admit, then plan the next run. Returns its end time (None: idle)."""
        assert self.plan is None
        for seq in self._pending_add:
            self._enqueue(seq)
        self._pending_add = []
        preempted = False
        while self.running and not (self._make_room(len(self.running), self._queued_sessions())
                                    or self._make_room(len(self.running))):
            victim = max(reversed(self.running.values()), key=lambda s: s.priority)  # the newest of the worst
            self._remove(victim)
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self._enqueue(victim, ahead=True)
            preempted = True
        prefill = prefill_sq = 0
        budget_full = False
        limit = self.kv_capacity * (1 - self.watermark)
        queued = self._queued_sessions()
        while self.waiting and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = seq.prompt_tokens + seq.generated
            new = need - self.sessions.get(seq.session, 0)
            if prefill and prefill + new > self.max_prefill_tokens:
                budget_full = True
                break
            # while requests run, a queued turn's session is not evicted for another (as TorchEngine)
            spare = queued if self.running else {seq.session}
            headroom = self.kv_capacity - limit if self.running else 0
            if not self._make_room(new + len(self.running) + 1 + headroom, spare):
                break
            self.waiting.popleft()
            self._admit(seq)
            prefill, prefill_sq = prefill + new, prefill_sq + new * need
        if not self.running:
            if self.waiting:
                seq = self.waiting[0]
                raise ValueError(f"replica {self.index}: request {seq.id} needs {seq.prompt_tokens + seq.target} "
                                 f"tokens of KV but the cache holds {self.kv_capacity}; use a larger TP size "
                                 "or a shorter max_new_tokens")
            return None
        batch = len(self.running)
        until_finish = self._finishes[0][0] - self.iters
        while True:  # drop stale entries (preempted or aborted requests)
            at, admit_seq, rid = self._finishes[0]
            seq = self.running.get(rid)
            if seq is not None and seq.admit_seq == admit_seq:
                until_finish = at - self.iters
                break
            heapq.heappop(self._finishes)
        until_full = (self.kv_capacity - self.kv_used() - self.held) // batch  # then sessions are evicted
        num_iters = 1 if budget_full else max(1, min(until_finish, until_full))
        times = self.cost.iteration_times(batch, self.kv_used(), num_iters, prefill, prefill_sq)
        self.plan = (self.clock, self.clock + np.cumsum(times), batch)
        self._prefills = prefill > 0
        self.version += 1
        return self.next_event()
