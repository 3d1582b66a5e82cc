"""Long-tailed response lengths: the paper's length mixture, drawn per prompt and launch.

:class:`LengthModel` is a two-component mixture over prompts. A prompt's log-scale is
``N(log median_tokens, prompt_sigma)``, or with probability ``long_fraction``
``N(log long_median_tokens, long_sigma)``; each response multiplies the scale by
``exp(response_sigma * N(0, 1))``. Every launch of a prompt samples fresh lengths for its responses,
but a prompt keeps its *length scale* across launches: hard prompts stay long (§3, §6.3 "some
difficult prompts consistently produce long responses"). Lengths are *natural* lengths: users cut
them at ``max_new_tokens``. For other caps than 16k the length scales are multiplied by
``cap / 16k`` (``scale_with_cap``): the paper states the tail relative to the cap, and Fig. 10b's
short-round rollout speedup at 32B/32k ("up to 7.8x") is what the scaled mixture gives (8.8x)
while the unscaled one gives 17x.

Two users draw the very same lengths: the run's ``--rollout.replay-lengths`` (forced through the
engine) and the simulator (:mod:`rollpacker.sim.workload`, which also fits the defaults to the
paper's statistics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np


@dataclass(frozen=True, kw_only=True)
class LengthModel:
    median_tokens: float = 482.0
    """Median response of an ordinary prompt."""
    prompt_sigma: float = 0.846
    """Spread of ordinary prompts' log length scale."""
    response_sigma: float = 0.892
    """Spread of one prompt's responses around its scale (log space)."""
    long_fraction: float = 0.025
    """Share of long prompts (their responses are long, launch after launch)."""
    long_median_tokens: float = 6811.0
    """Median scale of a long prompt."""
    long_sigma: float = 1.0
    """Spread of long prompts' log length scale."""
    prompt_tokens: int = 256
    """Tokens of every prompt."""
    reference_cap: int = 16384
    """The response cap the lengths above describe (the paper's statistics are of a 16k cap)."""
    scale_with_cap: bool = True
    """Scale the length scales by max_new_tokens / reference_cap (the tail is stated relative to the cap)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.median_tokens, self.long_median_tokens) < 1 or self.prompt_tokens < 1:
            raise ValueError(f"lengths: median_tokens={self.median_tokens}, long_median_tokens="
                             f"{self.long_median_tokens} and prompt_tokens={self.prompt_tokens} must be >= 1")
        if not 0 <= self.long_fraction <= 1 or min(self.prompt_sigma, self.response_sigma, self.long_sigma) < 0:
            raise ValueError(f"lengths: long_fraction={self.long_fraction} must be in [0, 1] and sigmas >= 0")

    def for_cap(self, cap: int) -> LengthModel:
        """This model for responses cut at ``cap``: the length scales times ``cap / reference_cap`` (a token at
        least: a small cap was refused for medians it never set)."""
        if not self.scale_with_cap or cap == self.reference_cap:
            return self
        s = cap / self.reference_cap
        return replace(self, median_tokens=max(1.0, self.median_tokens * s),
                       long_median_tokens=max(1.0, self.long_median_tokens * s), reference_cap=cap)

    def log_scale(self, row: int) -> float:
        return _log_scale(self, row)

    def sample(self, num_prompts: int, num: int, rng: np.random.Generator) -> np.ndarray:
        """Natural lengths of ``num`` responses each of ``num_prompts`` fresh prompts, [prompt, response]."""
        u, z = rng.random(num_prompts), rng.standard_normal(num_prompts)
        mu = np.where(u < self.long_fraction, math.log(self.long_median_tokens) + self.long_sigma * z,
                      math.log(self.median_tokens) + self.prompt_sigma * z)
        noise = rng.standard_normal((num_prompts, num))
        return np.maximum(1, np.rint(np.exp(mu[:, None] + self.response_sigma * noise)))

    def lengths(self, row: int, step: int, slot: int, num: int) -> np.ndarray:
        """Natural lengths of ``num`` fresh responses of ``row``, launched at ``slot`` of ``step``."""
        noise = np.random.default_rng([self.seed, 2, step, slot, row]).standard_normal(num)
        return np.maximum(1, np.rint(np.exp(self.log_scale(row) + self.response_sigma * noise))).astype(np.int64)

    def turn_length(self, row: int, step: int, slot: int, response: int, turn: int) -> int:
        """Natural length of turn ``turn`` of episode ``response`` of ``row`` launched at ``slot`` of
        ``step``: the row's scale, fresh noise per turn (an episode's turns are responses of one prompt)."""
        noise = np.random.default_rng([self.seed, 3, step, slot, row, response, turn]).standard_normal()
        return max(1, int(np.rint(np.exp(self.log_scale(row) + self.response_sigma * noise))))


@lru_cache(maxsize=1 << 20)
def _log_scale(model: LengthModel, row: int) -> float:
    rng = np.random.default_rng([model.seed, 1, row])
    long, z = rng.random() < model.long_fraction, rng.standard_normal()
    if long:
        return math.log(model.long_median_tokens) + model.long_sigma * z
    return math.log(model.median_tokens) + model.prompt_sigma * z


class LengthReplay:
    """Forced response lengths (``--rollout.replay-lengths``), drawn from the paper's long-tailed
    mixture (:class:`LengthModel`, scaled to ``max_new_tokens`` and cut there), which the engines
    then force (``ignore_eos``). A random model so rolls out the tail a trained one would, and the
    simulator replays the very same lengths. One per run.

    A response without environment draws a response length (:meth:`draw`); an episode's turn
    (``EPISODE#TURN``) a turn length. A partial response resumed in a later round (sorted_partial)
    keeps the length it was first given, as in the simulator, however often it is resumed (a resumed request
    aborted while queued brings back its earlier output, resumed again later): a length not given at this step
    or the last is forgotten, and those kept go into checkpoints."""

    def __init__(self, seed: int, max_new_tokens: int):
        self.model, self.cap = LengthModel(seed=seed).for_cap(max_new_tokens), max_new_tokens
        self.given: dict[str, list[int]] = {}
        """Request id -> [its forced length, the last step it was given at], for the partials a later round resumes."""
        self.step = 0

    def draw(self, row: int, step: int, slot: int, response: int) -> int:
        """The length of response ``response`` of the prompt ``row`` launched in ``slot`` at ``step``."""
        return min(self.cap, int(self.model.lengths(row, step, slot, response + 1)[response]))

    def turn(self, turn, row: int) -> int:
        """The forced length of ``turn`` (a :class:`~rollpacker.env.episode.TurnRequest`) of prompt ``row``,
        within its budget (a resumed partial gets at least one more token)."""
        episode, _, number = turn.id.partition("#")
        step, slot, response = (int(x) for x in episode.split(":"))
        if number:
            return min(turn.max_new_tokens, self.cap, self.model.turn_length(row, step, slot, response, int(number)))
        earlier = turn.resume_from
        length = self(turn.id, row, step, slot, response, earlier)
        return min(turn.max_new_tokens, max(length, len(earlier.token_ids) + 1) if earlier else length)

    def __call__(self, rid: str, row: int, step: int, slot: int, response: int, earlier=None) -> int:
        if step > self.step:  # no round resumes what was last given before the last step
            self.step, self.given = step, {k: v for k, v in self.given.items() if v[1] >= step - 1}
        kept = self.given.get(earlier.id) if earlier is not None else None
        length = kept[0] if kept else self.draw(row, step, slot, response)
        for key in (rid, earlier.id) if kept else (rid,):
            self.given[key] = [length, step]
        return length

    def load(self, state: dict) -> None:
        """A checkpoint's ``{"step", "given"}`` (one saved before the steps were kept: each length at its id's step)."""
        self.step = state["step"]
        self.given = {k: list(v) if isinstance(v, list) else [v, int(k.split(":")[0])]
                      for k, v in state["given"].items()}
