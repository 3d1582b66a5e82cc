"""Run by tests/dist/rollout/test_sglang_engine.py in its own process (SGLang on CPU, the test stubs on
PYTHONPATH): one SGLangEngine, every check of the adapter against transformers, TorchEngine and
the trainer. Each check's result goes to the JSON file ``argv[3]`` (``"ok"`` or its traceback), so
one failing check fails one test. Args: model a, model b (other weights), results path."""

import json
import sys
import time
import traceback
from pathlib import Path

import torch
from support.engine_pair import hf_greedy, hf_logits, hf_model, prompts

from rollpacker.dist import build_meshes
from rollpacker.model import load_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import Request, SamplingParams, generate, reference_logprobs
from rollpacker.rollout.sglang_engine import STREAM_INTERVAL, SGLangEngine
from rollpacker.rollout.torch_engine import TorchEngine
from rollpacker.train.config import TrainConfig
from rollpacker.train.trainer import Sample, Trainer


def greedy(rid: str, prompt: list[int], n: int = 16) -> Request:
    return Request(id=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))


def sampled(rid: str, prompt: list[int], n: int, seed: int) -> Request:
    return Request(id=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=n, temperature=1.2, seed=seed,
                                                                     ignore_eos=True))


def letters(ids: list[int]) -> str:
    """The text of ``ids`` for stop strings (the random model has no tokenizer): one letter per token."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


def tokens(outs: dict) -> dict[str, list[int]]:
    return {k: o.token_ids for k, o in outs.items()}


def greedy_matches_transformers_and_torch_engine(engine, a, b):
    assert not engine.logprobs_truncated
    reqs = [greedy(f"g{i}", p) for i, p in enumerate(prompts(4, 12))]
    got = generate(engine, reqs)
    torch_out = generate(TorchEngine(load_model(a), EngineConfig()), reqs)
    hf = hf_model(a)
    for r in reqs:
        out = got[r.id]
        assert out.token_ids == torch_out[r.id].token_ids == hf_greedy(hf, r.prompt_ids, 16), r.id
        assert out.finish_reason == "length" and out.first_token_time <= out.finish_time
        ref = reference_logprobs(hf_logits(hf, r.prompt_ids, out.token_ids), torch.tensor(out.token_ids), r.params)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def a_repetition_penalty_is_refused_and_the_engine_serves_on(engine, a, b):
    """SGLang's penalty counts only the tokens it generated (TorchEngine's, vLLM's and transformers' the prompt's
    too): refused by name, and a request after it runs."""
    penalized = greedy("p0", prompts(1, 12, seed=2)[0])
    penalized.params.repetition_penalty = 1.5
    try:
        engine.add(penalized)
    except ValueError as e:
        assert "not the prompt's" in str(e), e
    else:
        raise AssertionError("a repetition penalty was not refused")
    assert generate(engine, [greedy("after", penalized.prompt_ids)])["after"].finish_reason == "length"


def logprobs_equal_the_trainers(engine, a, b):
    """Sampled at T = 0.8: the rollout log-probs are what the trainer recomputes for the importance ratio."""
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    reqs = [Request(id=f"t{i}", prompt_ids=p, params=params) for i, p in enumerate(prompts(3, 10, seed=1))]
    got = generate(engine, reqs)
    trainer = Trainer(load_model(a), TrainConfig(), build_meshes(1, 0).train, temperature=0.8, num_steps=1)
    samples = [Sample(r.prompt_ids, got[r.id].token_ids, 0.0, got[r.id].logprobs) for r in reqs]
    with torch.no_grad():
        recomputed = trainer._logprobs(trainer.model, samples)
    torch.testing.assert_close(torch.tensor([x for s in samples for x in s.rollout_logprobs]), recomputed.float(),
                               atol=1e-4, rtol=0)


def abort_then_resume_continues_greedy(engine, a, b):
    prompt = prompts(1, 20, seed=2)[0]
    full = generate(engine, [greedy("full", prompt, 120)])["full"]
    engine.add(greedy("long", prompt, 120))
    engine.add(greedy("short", prompt[:10], 6))
    while not any(o.id == "short" for o in engine.step()):  # the long one is partway when the short one ends
        pass
    partial = engine.abort("long")
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 120, len(partial.token_ids)
    assert len(partial.logprobs) == len(partial.token_ids)
    try:
        engine.abort("long")
        raise AssertionError("a second abort did not raise")
    except KeyError:
        pass
    done = generate(engine, [Request(id="long", prompt_ids=prompt, params=greedy("long", prompt, 120).params,
                                     resume_from=partial)])["long"]
    assert done.token_ids == full.token_ids
    torch.testing.assert_close(done.logprobs, full.logprobs, atol=1e-4, rtol=0)
    engine.add(greedy("raced", prompt, 6))
    while engine.live["raced"].out.finish_reason is None:  # SGLang finishes it before the abort reaches it
        time.sleep(0.01)
    raced = engine.abort("raced")  # whole, not a partial to resume
    assert raced.finish_reason == "length" and raced.token_ids == full.token_ids[:6], raced
    assert not engine.has_unfinished()


def an_abort_right_after_add_ends_the_request(engine, a, b):
    """SGLang ignores an abort of a request it has not registered yet: one aborted right after its add (a round
    whose quota filled in the same poll) ran on to its limit, and the abort waited for it (up to 60 s)."""
    prompt = prompts(1, 20, seed=3)[0]
    for i in range(4):
        engine.add(greedy(f"quick{i}", prompt, 120))
        out = engine.abort(f"quick{i}")
        assert out.finish_reason == "abort" and len(out.token_ids) < 120, (i, out.finish_reason, len(out.token_ids))
    assert not engine.has_unfinished()
    assert generate(engine, [greedy("after", prompt, 8)])["after"].token_ids == hf_greedy(hf_model(a), prompt, 8)


def bad_requests_raise(engine, a, b):
    pool, engine.pool_tokens = engine.pool_tokens, 304  # a pool SGLang would never start 100 + 176 in
    for request, message in ((greedy("bad", [], 4), "empty"), (greedy("bad", [1] * 600, 4), "max_model_len"),
                             (greedy("bad", [1] * 100, 176), "raise engine.kv_memory_mb"),
                             (greedy("bad", [1, engine.vocab_size], 4), "outside the vocabulary"),
                             (greedy("bad", [-1, 1], 4), "outside the vocabulary")):
        try:
            engine.add(request)
            raise AssertionError(f"no error for a request with {message}")
        except ValueError as e:
            assert message in str(e), e
    engine.pool_tokens = pool
    assert not engine.has_unfinished()


def a_prompt_at_the_context_edge_is_served(engine, a, b):
    """Prompts of max_model_len - 4 and - 1 tokens, which the engine takes: SGLang aborted an input within 6 tokens
    of its context length, and that one request failed the whole step (its neighbour's too)."""
    edge = engine.max_model_len
    outs = generate(engine, [greedy("other", prompts(1, 8)[0], 3), greedy("minus4", prompts(1, edge - 4, seed=1)[0], 3),
                             greedy("minus1", prompts(1, edge - 1, seed=2)[0], 3)])
    got = {rid: (o.finish_reason, len(o.token_ids)) for rid, o in outs.items()}
    assert got == {"other": ("length", 3), "minus4": ("length", 3), "minus1": ("length", 1)}, got
    assert not engine.has_unfinished()


def stop_string_ends_generation_as_on_torch_engine(engine, a, b):
    """The adapter matches stop strings on the streamed tokens (SGLang runs without a tokenizer), also
    inside an update of several tokens: the same tokens as TorchEngine."""
    prompt = prompts(1, 12, seed=4)[0]
    full = generate(engine, [greedy("whole", prompt, 24)])["whole"].token_ids
    stop = letters(full)[11:13]  # tokens 12 and 13: inside SGLang's second update (tokens 2-9, 10-17)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    outs = []
    for eng in (engine, TorchEngine(load_model(a), EngineConfig())):
        eng.decode = letters
        outs.append(generate(eng, [Request(id="stop", prompt_ids=prompt, params=params)])["stop"])
    engine.decode = None
    first = next(n for n in range(1, 25) if stop in letters(full[:n]))
    assert [o.token_ids for o in outs] == [full[:first]] * 2 and first < 24, (first, outs)
    assert first % STREAM_INTERVAL != 1, first  # SGLang's updates end at tokens 1, 9, 17, 24
    assert [o.finish_reason for o in outs] == ["stop"] * 2 and not engine.has_unfinished()
    assert generate(engine, [greedy("after", prompt, 24)])["after"].token_ids == full  # SGLang's request ended


def seeded_sampling_reproduces_and_resumes(engine, a, b):
    """SGLang's seeded sampling is keyed by position: the same seed gives the same tokens, another seed
    others, and a seeded request aborted partway and resumed equals the uninterrupted one."""
    prompt = prompts(1, 8, seed=5)[0]
    one, again, other = (generate(engine, [sampled(rid, prompt, 40, seed)])[rid].token_ids
                         for rid, seed in (("s1", 1), ("s1b", 1), ("s2", 2)))
    assert one == again and one != other, (one, again, other)
    full = generate(engine, [sampled("f", prompt, 100, seed=5)])["f"]
    engine.add(sampled("r", prompt, 100, seed=5))
    engine.add(sampled("short", prompt[:4], 6, seed=9))
    while not any(o.id == "short" for o in engine.step()):
        pass
    partial = engine.abort("r")
    assert 0 < len(partial.token_ids) < 100, len(partial.token_ids)
    done = generate(engine, [Request(id="r", prompt_ids=prompt, params=sampled("r", prompt, 100, 5).params,
                                     resume_from=partial)])["r"]
    assert done.token_ids == full.token_ids, (len(partial.token_ids), done.token_ids, full.token_ids)


def a_step_is_a_decode_step(engine, a, b):
    """SGLang streams every STREAM_INTERVAL tokens, yet step() returns about once per token made (the
    controller's polls count steps as tokens)."""
    for i, prompt in enumerate(prompts(4, 12, seed=5)):
        engine.add(greedy(f"paced{i}", prompt, 60))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert STREAM_INTERVAL > 1 and 60 - STREAM_INTERVAL <= steps <= 61, steps


def update_weights_then_release_and_resume(engine, a, b):
    """The other model's weights under rollpacker's names (prompts of 150 tokens: a stale cache would
    show): outputs equal transformers' on them, also after a memory release; then back."""
    reqs = [greedy(f"w{i}", p, 12) for i, p in enumerate(prompts(3, 150, seed=4))]
    generate(engine, reqs)
    engine.update_weights(load_model(b).named_parameters())
    hf = hf_model(b)
    expected = {r.id: hf_greedy(hf, r.prompt_ids, 12) for r in reqs}
    assert tokens(generate(engine, reqs)) == expected
    engine.release_memory()
    try:
        engine.step()
        raise AssertionError("step() after release_memory() did not raise")
    except RuntimeError as e:
        assert "release_memory" in str(e)
    engine.update_weights(load_model(b).named_parameters())  # while released: the weights come back first
    engine.release_memory()  # again (a RolloutPipe training rank does this): the woken weights go back
    engine.resume_memory()
    assert tokens(generate(engine, reqs)) == expected
    engine.release_memory()  # and once more from awake (a stream-freed rank after a pipe job did this)
    engine.resume_memory()
    engine.update_weights(load_model(a).named_parameters())
    assert generate(engine, reqs[:1])[reqs[0].id].token_ids == hf_greedy(hf_model(a), reqs[0].prompt_ids, 12)


def release_and_push_right_after_a_finish(engine, a, b):
    """SGLang can still be running a request the adapter has finished (one it aborted at a stop
    string) for a scheduler iteration or more. A release then (SGLang asserts idleness: its scheduler
    dies) or a push (SGLang's flush fails) waits for SGLang to be idle. Last: before the fix it killed
    the engine."""
    weights, engine.decode = list(load_model(a).named_parameters()), letters
    for i, prompt in enumerate(prompts(8, 20, seed=6)):
        stop = letters(generate(engine, [greedy(f"head{i}", prompt, 3)])[f"head{i}"].token_ids)[1:]
        params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True, stop=(stop,))
        out = generate(engine, [Request(id=f"stop{i}", prompt_ids=prompt, params=params)])[f"stop{i}"]
        assert len(out.token_ids) <= 3, out  # SGLang runs on past it until the adapter's abort arrives
        if i % 2:
            engine.update_weights(weights)
        else:
            engine.release_memory()
            engine.resume_memory()
    engine.decode = None
    prompt = prompts(1, 20, seed=6)[0]
    assert generate(engine, [greedy("after", prompt, 8)])["after"].token_ids == hf_greedy(hf_model(a), prompt, 8)


CHECKS = [greedy_matches_transformers_and_torch_engine, a_repetition_penalty_is_refused_and_the_engine_serves_on,
          logprobs_equal_the_trainers, abort_then_resume_continues_greedy, an_abort_right_after_add_ends_the_request,
          bad_requests_raise, a_prompt_at_the_context_edge_is_served, stop_string_ends_generation_as_on_torch_engine,
          seeded_sampling_reproduces_and_resumes,
          a_step_is_a_decode_step, update_weights_then_release_and_resume, release_and_push_right_after_a_finish]


def main(a: Path, b: Path, out: Path) -> None:
    engine = SGLangEngine(a, EngineConfig(kind="sglang", kv_memory_mb=8, max_num_seqs=16), dtype=torch.float32,
                          log_level="warning")
    results = {}
    for check in CHECKS:
        try:
            check(engine, a, b)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc()
            for rid in list(engine.live):  # the next check starts idle
                engine.abort(rid)
        out.write_text(json.dumps(results))
        print(check.__name__, "ok" if results[check.__name__] == "ok" else "FAILED", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
