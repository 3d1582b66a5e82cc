"""The edge of a real controller round without a model or ranks (:func:`rollpacker.exchange.run_round`):
a one-rank world, an engine that adds a token per step, rewards scored at once; and a clock that
times TorchEngine's decode steps by what they did (``engine.speculative auto``'s realized payoff)."""

from __future__ import annotations

from rollpacker.rollout.engine import EngineStats, Output


class InstantRewards:
    """The reward scheduler's interface, scoring at once (what the simulator assumes for decisions)."""

    def __init__(self, reward):
        self.reward, self.done = reward, []

    def submit(self, key, row, output, held_out=False):
        self.done.append((key, self.reward(row, key)))

    def submit_group(self, keys, row, outputs):
        """No group function."""

    def poll(self):
        done, self.done = self.done, []
        return done

    def wait(self, keys=None, timeout=None):
        return self.poll()


class OneReplica:
    """The controller's view of a one-rank world (what :class:`rollpacker.dist.Meshes` offers)."""

    rank, num_replicas, replica, is_replica_leader, rollout_control, freed = 0, 1, 0, True, None, False

    def broadcast(self, obj, group=None):
        return obj

    def scatter(self, objs, group=None):
        return objs[0]

    def replicas(self, group=None):
        return [0]

    def gather(self, obj, group=None):
        return [obj]


class LengthTableEngine:
    """The engine edge (no model here): each step adds a token to every running request; a request
    finishes at ``length(row, response)`` tokens, the row being its one prompt token."""

    def __init__(self, length):
        self.length, self.running, self.num_prefill_tokens = length, {}, 0

    def add(self, req):
        self.running[req.id] = Output(id=req.id, prompt_ids=req.prompt_ids)

    def abort(self, rid):
        out = self.running.pop(rid)
        out.finish_reason = "abort"
        return out

    def step(self):
        done = []
        for rid, out in list(self.running.items()):
            out.token_ids.append(1)
            out.logprobs.append(0.0)
            if len(out.token_ids) == self.length(out.prompt_ids[0], int(rid.split(":")[2])):
                out.finish_reason = "length"
                done.append(self.running.pop(rid))
        return done

    def has_unfinished(self):
        return bool(self.running)

    def stats(self):
        return EngineStats(num_running=len(self.running), num_waiting=0, num_preemptions=0, num_generated_tokens=0,
                           num_prefill_tokens=self.num_prefill_tokens)


class StepClock:
    """A clock for TorchEngine's ``auto`` payoff (read before and after each decode step): a plain step
    takes 1 s, a verify step ``verify_s``, and a step that asked the drafter ``propose_s`` more. Set
    ``engine`` once the engine is built."""

    def __init__(self, verify_s: float, propose_s: float = 0.0):
        self.verify_s, self.propose_s, self.now, self.reads, self.engine = verify_s, propose_s, 0.0, 0, None
        self.verified = self.proposed = 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the end of a step
            verified, proposed = self.engine.spec.num_verify_steps, self.engine.num_proposing_steps
            self.now += self.verify_s if verified > self.verified else 1.0
            self.now += self.propose_s if proposed > self.proposed else 0.0
            self.verified, self.proposed = verified, proposed
        return self.now


def single_turn_runner(prompt=lambda row: [1, 2], max_new_tokens: int = 8):
    """The round's runner of responses without environment (each the one-turn episode of its row's
    ``prompt(row)``), as the exchange builds it."""
    from rollpacker.env.setup import Environments
    from rollpacker.schedule.runner import EpisodeRunner

    envs = Environments.none(max_new_tokens)
    return EpisodeRunner(envs.maker(range(1 << 30), prompt), seed=envs.seed, environment=False)
