"""TorchEngine's resident sessions (``Request.session``): an episode's next turn prefills only its new
tokens and gets the tokens and log-probs of a turn prefilled from scratch, evicted or not."""

from __future__ import annotations

import pytest
import torch

from rollpacker.model import load_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import DraftContext, Request, SamplingParams, generate
from rollpacker.rollout.torch_engine import TorchEngine

STARTS = [[1, 2, 3], list(range(10, 30)), [7] * 9, list(range(70, 77))]
"""The first prompt of each episode."""


def engine(path, **kw) -> TorchEngine:
    return TorchEngine(load_model(path), EngineConfig(block_size=4, **kw))


def observation(episode: int, turn: int) -> list[int]:
    """The environment's reply to a turn: a few tokens of its own."""
    return [50 + 7 * episode + turn + j for j in range(2 + (episode + turn) % 3)]


def run_episodes(eng: TorchEngine, turns: int, keep: bool, new_tokens: int = 12,
                 attempts: list[list[int]] | None = None) -> list[dict[str, object]]:
    """Every episode of ``STARTS`` for ``turns`` turns, all turns of one index at once: each turn's prompt
    is the last turn's prompt + response + an observation. Even episodes greedy, odd ones sampled
    (seeded); ``keep`` names each request's session; ``attempts`` offers each episode's turns an
    earlier attempt's tokens past its start as a ``partial`` draft context. Outputs per turn, by id."""
    prompts = [list(p) for p in STARTS]
    outputs = []
    for turn in range(turns):
        reqs = [Request(id=f"e{e}t{turn}", prompt_ids=p, session=f"e{e}" if keep else None, params=SamplingParams(
            max_new_tokens=new_tokens - e, temperature=0.9 * (e % 2), seed=31 * e + turn, ignore_eos=True),
            draft_context=(DraftContext(source="partial", token_ids=tuple(attempts[e])),) if attempts else ())
            for e, p in enumerate(prompts)]
        done = generate(eng, reqs)
        outputs.append(done)
        prompts = [p + done[f"e{e}t{turn}"].token_ids + observation(e, turn) for e, p in enumerate(prompts)]
    return outputs


def assert_same(outputs: list[dict], reference: list[dict]) -> None:
    for turn, ref in zip(outputs, reference):
        assert {k: o.token_ids for k, o in turn.items()} == {k: o.token_ids for k, o in ref.items()}
        for k, o in turn.items():
            torch.testing.assert_close(o.logprobs, ref[k].logprobs, rtol=0, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def from_scratch(qwen2_dir):
    return run_episodes(engine(qwen2_dir), 3, keep=False)


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_next_turn_prefills_only_its_new_tokens(qwen2_dir, from_scratch, speculative):
    """Three turns of four episodes (greedy and sampled): every token and log-prob is that of turns
    prefilled from scratch, and after the first turn each prefill computes only the last response
    token and the observation; ``end_session`` frees every block."""
    eng = engine(qwen2_dir, speculative=speculative)
    outputs = run_episodes(eng, 3, keep=True)
    assert_same(outputs, from_scratch)
    first_turn = sum(map(len, STARTS))
    new = sum(1 + len(observation(e, t)) for e in range(len(STARTS)) for t in range(2))
    stats = eng.stats()
    assert stats.num_prefill_tokens == first_turn + new
    assert stats.num_reused_prefill_tokens == sum(len(o.prompt_ids) - 1 - len(observation(int(k[1]), t - 1))
                                                  for t in (1, 2) for k, o in outputs[t].items())
    assert stats.num_session_evictions == 0 and stats.num_preemptions == 0
    assert len(eng.sessions) == len(STARTS) and len(eng.free_blocks) < eng.num_blocks
    for e in range(len(STARTS)):
        eng.end_session(f"e{e}")
    assert len(eng.sessions) == 0 and sorted(eng.free_blocks) == list(range(eng.num_blocks))
    eng.end_session("e0")  # ended already: nothing to free


def test_sessions_are_evicted_under_a_small_kv_budget(qwen2_dir, from_scratch):
    """With 35 blocks of 4 tokens, the four episodes cannot all stay resident while the others run:
    sessions are evicted (recomputed by their next turn), the tokens and log-probs stay those of
    turns prefilled from scratch, and no block is lost."""
    eng = engine(qwen2_dir, kv_memory_mb=0.07)
    assert eng.num_blocks == 35
    assert_same(run_episodes(eng, 3, keep=True), from_scratch)
    stats = eng.stats()
    assert stats.num_session_evictions > 0
    assert 0 < stats.num_reused_prefill_tokens
    eng.release_memory()  # frees the sessions still resident
    assert len(eng.sessions) == 0 and sorted(eng.free_blocks) == list(range(eng.num_blocks))


def test_a_prompt_that_leaves_the_session_reuses_the_common_prefix_only(qwen2_dir):
    """A next request whose prompt diverges from the session's tokens reuses the common prefix and
    recomputes the rest; new weights drop every session (their K/V are stale); an aborted turn keeps
    no KV and loses no block."""
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    eng = engine(qwen2_dir)
    first = generate(eng, [Request(id="a", prompt_ids=list(range(20)), params=params, session="s")])["a"]
    edited = list(range(13)) + [90, 91] + first.token_ids[:3]
    again = generate(eng, [Request(id="b", prompt_ids=edited, params=params, session="s")])["b"]
    scratch = generate(engine(qwen2_dir), [Request(id="b", prompt_ids=edited, params=params)])["b"]
    assert again.token_ids == scratch.token_ids
    torch.testing.assert_close(again.logprobs, scratch.logprobs, rtol=0, atol=1e-5)
    assert eng.stats().num_reused_prefill_tokens == 13
    eng.update_weights(load_model(qwen2_dir).state_dict().items())
    assert len(eng.sessions) == 0 and sorted(eng.free_blocks) == list(range(eng.num_blocks))
    generate(eng, [Request(id="c", prompt_ids=edited, params=params, session="s")])
    eng.add(Request(id="d", prompt_ids=edited + [5, 6], params=params, session="s"))
    eng.step(), eng.step()  # its prefill took the session's blocks over; an abort keeps nothing
    assert eng.abort("d").finish_reason == "abort" and eng.stats().num_reused_prefill_tokens == 13 + len(edited)
    assert len(eng.sessions) == 0 and sorted(eng.free_blocks) == list(range(eng.num_blocks))


def test_a_turn_running_across_a_weight_push_leaves_no_kv_for_the_next(qwen2_dir):
    """A session's turn in flight when new weights arrive finishes with K/V partly of the old weights: its next turn
    recomputes them (it reused them: its tokens and log-probs were the old weights')."""
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    new = load_model(qwen2_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.5)
    eng = engine(qwen2_dir)
    eng.add(Request(id="t1", prompt_ids=list(range(1, 21)), params=params, session="s"))
    eng.step(), eng.step()  # its prefill and a decode step
    eng.update_weights(new.named_parameters())
    first = generate(eng, [])["t1"]
    second = list(range(1, 21)) + first.token_ids + [50, 51]
    again = generate(eng, [Request(id="t2", prompt_ids=second, params=params, session="s")])["t2"]
    scratch = TorchEngine(new, EngineConfig(block_size=4))
    expected = generate(scratch, [Request(id="t2", prompt_ids=second, params=params)])["t2"]
    assert eng.stats().num_reused_prefill_tokens == 0 and again.token_ids == expected.token_ids
    torch.testing.assert_close(again.logprobs, expected.logprobs, rtol=0, atol=1e-5)


def test_a_regenerated_episode_drafts_from_its_cut_attempt(qwen2_dir, from_scratch):
    """An episode cut in its third turn and regenerated from its start (a deterministic environment),
    each turn offered the cut attempt (its responses and observations past the start: one sequence,
    as the controller's ``partial`` drafts) with speculation on: the tokens and log-probs are those of
    plain decoding, and the attempt's drafts are verified and mostly accepted, across turns."""
    cut = [(from_scratch[2][f"e{e}t2"].prompt_ids + from_scratch[2][f"e{e}t2"].token_ids[:5])[len(start):]
           for e, start in enumerate(STARTS)]
    eng = engine(qwen2_dir, speculative="on", spec_max_tokens=4)
    assert_same(run_episodes(eng, 3, keep=True, attempts=cut), from_scratch)
    spec = eng.stats().spec
    assert spec.num_accepted_tokens["partial"] > 0.5 * spec.num_draft_tokens["partial"], spec
