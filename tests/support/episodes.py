"""The smallest driver of episodes, for tests: one engine in this process, environments in an
:class:`~rollpacker.env.workers.EnvPool`. Each turn is an engine request, each step a worker call;
nothing is scheduled. The round is the product's driver; this one shows the wiring it does."""

from __future__ import annotations

import dataclasses
import time

from rollpacker.data.chat import encode
from rollpacker.env.episode import Done, Episode, StepEnv, TurnRequest, reset_seed
from rollpacker.rollout.engine import Request, SamplingParams


@dataclasses.dataclass
class Run:
    episodes: dict[str, Episode]
    steps: dict[str, int]
    """Environment steps per episode (the replies that came back)."""
    errors: list[str]


def run_episodes(engine, pool, bridge, rows: list[dict], *, seed: int = 0, max_turns: int = 3, max_tokens: int = 256,
                 max_new_tokens: int = 64, temperature: float = 1.0, chat_template: bool = False,
                 timeout: float = 120.0) -> Run:
    """Every row's episode to its end; ``bridge`` is the tokenizer's :class:`~rollpacker.env.render.ChatBridge`."""
    run = Run({}, {}, [])
    for k, row in enumerate(rows):
        key = f"0:{k}:0"
        pool.open_episode(key, row, reset_seed(seed, f"0:{k}"))
    by_row = {f"0:{k}:0": row for k, row in enumerate(rows)}
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=bridge.stop)
    open_keys, deadline = set(by_row), time.monotonic() + timeout

    def turn(episode: Episode, request: TurnRequest) -> None:
        engine.add(Request(id=request.id, prompt_ids=request.prompt_ids, params=dataclasses.replace(
            params, max_new_tokens=request.max_new_tokens, seed=request.seed)))

    def after(key: str, episode: Episode, next_: TurnRequest | StepEnv | Done) -> None:
        if isinstance(next_, TurnRequest):
            turn(episode, next_)
        elif isinstance(next_, StepEnv):
            pool.step_episode(key, next_.action)
        else:
            pool.close_episode(key)

    while open_keys:
        assert time.monotonic() < deadline, f"episodes still open: {open_keys}"
        for reply in pool.poll():
            if reply.kind == "close":
                open_keys.discard(reply.key)
                continue
            if reply.error:  # the episode ends, trained on nothing (one that failed to open never started)
                run.errors.append(reply.error)
                if reply.key in run.episodes:
                    run.episodes[reply.key].fail(reply.error)
                pool.close_episode(reply.key)
                continue
            if reply.kind == "open":
                prompt, info = reply.value
                row = by_row[reply.key]
                ids = encode(bridge.tokenizer, row["prompt"] if prompt is None else prompt,
                             chat_template=chat_template, tools=info.get("tools"))
                episode = run.episodes[reply.key] = Episode(reply.key, ids, bridge, seed=seed, max_turns=max_turns,
                                                            max_tokens=max_tokens, max_new_tokens=max_new_tokens,
                                                            max_context=engine.max_model_len)
                turn(episode, episode.next_turn())
            else:
                run.steps[reply.key] = run.steps.get(reply.key, 0) + 1
                after(reply.key, run.episodes[reply.key], run.episodes[reply.key].on_step(reply.value))
        for out in engine.step() if engine.has_unfinished() else []:
            key = out.id.split("#")[0]
            after(key, run.episodes[key], run.episodes[key].on_turn(out.token_ids, out.logprobs, out.finish_reason))
        if not engine.has_unfinished():
            time.sleep(0.01)
    return run

