"""TorchEngine against a plain full-recompute decode, on real (tiny, random) models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.fakes import StepClock

from rollpacker.model import CausalAttention, load_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import DraftContext, Request, SamplingParams, generate
from rollpacker.rollout.spec_cost import SpecCost
from rollpacker.rollout.torch_engine import TorchEngine

PROMPTS = [[1, 2, 3], [5] * 20, [7, 8, 9, 10, 11, 12, 13], list(range(40)), [42], list(range(60, 90))]
NEW = [30, 5, 60, 17, 90, 12]


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after ``prompt`` and their log-probs, recomputing the whole context per token."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = torch.tensor(tokens)
            logits = model.logits(model(t, torch.arange(len(t)), CausalAttention([len(t)])))[-1]
            tokens.append(int(logits.argmax()))
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[tokens[-1]]))
    return tokens[len(prompt):], logprobs


def greedy_requests(**kw) -> list[Request]:
    return [
        Request(id=f"r{i}", prompt_ids=p, params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw))
        for i, (p, n) in enumerate(zip(PROMPTS, NEW))
    ]


def sampled_requests(seed_offset: int = 0) -> list[Request]:
    return [
        Request(id=f"s{i}", prompt_ids=p, params=SamplingParams(
            max_new_tokens=n, temperature=0.9, top_p=0.9 if i % 2 else 1.0, top_k=20 if i % 3 == 0 else 0,
            seed=1000 + i + seed_offset, ignore_eos=True))
        for i, (p, n) in enumerate(zip(PROMPTS, NEW))
    ]


@pytest.fixture(scope="module")
def reference_with_logprobs(qwen2_dir):
    model = load_model(qwen2_dir)
    return {f"r{i}": reference_greedy(model, p, n) for i, (p, n) in enumerate(zip(PROMPTS, NEW))}


@pytest.fixture(scope="module")
def reference(reference_with_logprobs):
    return {k: tokens for k, (tokens, _) in reference_with_logprobs.items()}


def engine(path, **kw) -> TorchEngine:
    return TorchEngine(load_model(path), EngineConfig(**{"block_size": 4, **kw}))


def test_greedy_batch_equals_reference_decode(qwen2_dir, reference):
    eng = engine(qwen2_dir)
    outs = generate(eng, greedy_requests())
    assert {k: o.token_ids for k, o in outs.items()} == reference
    for o in outs.values():
        assert o.finish_reason == "length" and len(o.logprobs) == len(o.token_ids)
        assert o.first_token_time <= o.finish_time
        assert all(lp <= 0 for lp in o.logprobs)
    assert eng.stats().num_preemptions == 0
    assert eng.stats().num_generated_tokens == sum(NEW)


def test_tiny_kv_budget_preempts_and_keeps_outputs(qwen2_dir, reference):
    eng = engine(qwen2_dir, kv_memory_mb=0.07)  # 34 blocks of 4 tokens: not all requests fit
    outs = generate(eng, greedy_requests())
    assert {k: o.token_ids for k, o in outs.items()} == reference
    assert eng.stats().num_preemptions > 0
    assert sum(o.num_preemptions for o in outs.values()) == eng.stats().num_preemptions


def test_abort_returns_partial_and_resume_continues_exactly(qwen2_dir, reference):
    eng = engine(qwen2_dir)
    for r in greedy_requests():
        eng.add(r)
    early = {o.id: o for _ in range(8) for o in eng.step()}
    partial = eng.abort("r2")
    assert partial.finish_reason == "abort"
    assert 0 < len(partial.token_ids) < NEW[2] and len(partial.logprobs) == len(partial.token_ids)
    assert partial.token_ids == reference["r2"][: len(partial.token_ids)]
    with pytest.raises(KeyError, match="r2"):
        eng.abort("r2")
    # resume on another engine (a migration), by recomputation
    other = engine(qwen2_dir)
    resumed = generate(other, [Request(id="r2", prompt_ids=PROMPTS[2], params=greedy_requests()[2].params,
                                       resume_from=partial)])["r2"]
    assert resumed.token_ids == reference["r2"]
    assert resumed.logprobs[: len(partial.logprobs)] == partial.logprobs
    rest = early | generate(eng, [])
    assert {k: o.token_ids for k, o in rest.items()} == {k: v for k, v in reference.items() if k != "r2"}


def test_running_set_changes_mid_decode_keep_outputs(qwen2_dir, reference):
    """The decode workspace follows the running set row by row: arrivals between decode steps,
    an abort and its resume on the same engine, and finishes leave every output equal to the
    reference."""
    eng = engine(qwen2_dir)
    reqs = greedy_requests()
    done = {}
    for r in reqs[:4]:  # a new request after every three decode steps
        eng.add(r)
        for _ in range(4):
            done |= {o.id: o for o in eng.step()}
    partial = eng.abort("r3")
    assert 0 < len(partial.token_ids) < NEW[3]
    for _ in range(5):
        done |= {o.id: o for o in eng.step()}
    eng.add(Request(id="r3", prompt_ids=PROMPTS[3], params=reqs[3].params, resume_from=partial))
    done |= generate(eng, reqs[4:])
    assert {k: o.token_ids for k, o in done.items()} == reference
    assert eng.stats().num_preemptions == 0


def ragged_requests() -> list[Request]:
    """18 requests on the reference prompts, two of each in a row (one greedy, one sampled with a
    seed), of lengths whose contexts cross the workspace's 16/32/64 capacities while they decode."""
    reqs = []
    for i in range(18):
        p = [2, 0, 5, 1, 4, 3, 2, 0, 1][i // 2]
        new = NEW[p] - 7 * i % (NEW[p] // 2 + 1)
        params = (SamplingParams(max_new_tokens=new, temperature=0.8, top_k=30, seed=i, ignore_eos=True) if i % 2
                  else SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
        reqs.append(Request(id=f"g{i}-r{p}", prompt_ids=PROMPTS[p], params=params))
    return reqs


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_ragged_stream_updates_the_workspace_row_by_row(qwen2_dir, reference_with_logprobs, speculative):
    """A ragged stream: four requests at first, then two every fourth step (a greedy and a sampled
    one of one prompt, whose rows outgrow their workspace group together), a running request
    aborted every seventh step and resumed on the same engine five steps later, preemptions forced
    by the KV budget, and finishes all along. The decode workspace drops, appends and moves rows
    (alone and several at once) through all of it, each length group holding at most 1.5x the rows
    it uses and freed when empty, and every output equals its reference (greedy:
    the full-recompute decode; sampled: the same requests on a fresh engine with room for all of
    them): the same tokens, and log-probs equal up to float rounding (a wrong K or V column shifts
    them by more). With speculation on, verify steps append several tokens to some rows and leave
    rejected columns behind, through the same arrivals, aborts and preemptions."""
    reqs = ragged_requests()
    sampled = [r for r in reqs if r.params.temperature > 0]
    expected = {k: (o.token_ids, o.logprobs) for k, o in generate(engine(qwen2_dir), sampled).items()}
    for r in reqs:
        if r.params.temperature == 0:
            tokens, logprobs = reference_with_logprobs[r.id.split("-")[1]]
            expected[r.id] = tokens[: r.params.max_new_tokens], logprobs[: r.params.max_new_tokens]
    eng = engine(qwen2_dir, kv_memory_mb=0.07, max_num_seqs=6, speculative=speculative)  # 34 blocks of 4 tokens
    arrivals, resumes, done = list(reqs), {}, {}
    num_aborts = 0
    for step in range(10_000):
        for _ in range(4 if step == 0 else 2 if step % 4 == 0 and arrivals else 0):
            eng.add(arrivals.pop(0))
        if step % 7 == 6 and step > 12 and num_aborts < 8 and eng.running:
            seq = eng.running[step % len(eng.running)]
            resumes[step + 5] = Request(id=seq.req.id, prompt_ids=seq.req.prompt_ids, params=seq.req.params,
                                        resume_from=eng.abort(seq.req.id))
            num_aborts += 1
        if step in resumes:
            eng.add(resumes.pop(step))
        done |= {o.id: o for o in eng.step()}
        for g in eng.batch.groups.values() if eng.batch else ():  # each holds at most 1.5x the rows it uses
            assert 0 < 2 * g.rows <= 3 * len(g.seqs), (g.capacity, g.rows, len(g.seqs))
        if not (arrivals or resumes or eng.has_unfinished()):
            break
    assert {k: o.token_ids for k, o in done.items()} == {k: tokens for k, (tokens, _) in expected.items()}
    for k, o in done.items():
        torch.testing.assert_close(o.logprobs, expected[k][1], rtol=0, atol=1e-5, msg=k)
    assert num_aborts == 8 and eng.stats().num_preemptions >= (5 if speculative == "off" else 1), eng.stats()
    assert eng.batch.groups == {} and eng.workspace_bytes == 0  # every row left with its request, every group freed
    spec = eng.stats().spec
    assert (spec.num_verify_steps > 0 and sum(spec.num_accepted_tokens.values()) > 0) == (speculative == "on")
    assert eng.drafter is None or eng.drafter.prompts == {}  # every prompt's index left with its last request


def sibling_requests(draft_context: dict[str, tuple[int, ...]] | None = None) -> list[Request]:
    """Three siblings per prompt (greedy; T 0.9 top-p 0.9; T 0.7 top-k 20), each offered
    ``draft_context[id]`` as an earlier epoch's response where it holds one."""
    reqs, draft_context = [], draft_context or {}
    for i, (p, n) in enumerate(zip(PROMPTS[:4], (24, 12, 32, 16))):
        for j, (t, top_p, top_k) in enumerate([(0, 1, 0), (0.9, 0.9, 0), (0.7, 1, 20)]):
            rid = f"p{i}-{j}"
            context = (DraftContext(source="epoch", token_ids=draft_context[rid]),) if rid in draft_context else ()
            reqs.append(Request(id=rid, prompt_ids=p, draft_context=context, params=SamplingParams(
                max_new_tokens=n, temperature=t, top_p=top_p, top_k=top_k, seed=10 * i + j, ignore_eos=True)))
    return reqs


def run(eng: TorchEngine, reqs: list[Request]) -> tuple[dict, list[tuple[int, int]]]:
    """Outputs by id, and per step (running requests before it, verify steps it made)."""
    for r in reqs:
        eng.add(r)
    done, trace = {}, []
    while eng.has_unfinished():
        before, verified = len(eng.running), eng.stats().spec.num_verify_steps
        done |= {o.id: o for o in eng.step()}
        trace.append((before, eng.stats().spec.num_verify_steps - verified))
    return done, trace


def test_speculation_changes_no_token(qwen2_dir):
    """Greedy, top-p and top-k siblings, each offered the response it will produce as an earlier
    epoch's (its own seed's: the coupled draws accept such drafts): every token and log-prob is
    the plain engine's, in fewer steps, drafts from several sources verified; a second run is
    bitwise the first."""
    plain, plain_trace = run(engine(qwen2_dir), sibling_requests())
    context = {k: tuple(o.token_ids) for k, o in plain.items()}
    eng = engine(qwen2_dir, speculative="on", spec_max_tokens=4)
    spec, spec_trace = run(eng, sibling_requests(context))
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    for k, o in spec.items():
        torch.testing.assert_close(o.logprobs, plain[k].logprobs, rtol=0, atol=1e-5, msg=k)
    stats = eng.stats().spec
    assert len(spec_trace) < len(plain_trace) and stats.num_verify_steps > 0
    assert stats.num_accepted_tokens["epoch"] > 0.5 * stats.num_draft_tokens["epoch"], stats
    assert {"epoch", "self"} <= stats.num_drafts.keys(), stats
    again, _ = run(engine(qwen2_dir, speculative="on", spec_max_tokens=4), sibling_requests(context))
    assert {k: o.logprobs for k, o in again.items()} == {k: o.logprobs for k, o in spec.items()}


@pytest.mark.parametrize("at", [2, 12])
def test_speculation_counts_no_draft_token_past_a_stop(qwen2_dir, at):
    """A draft that runs through a stop token: the row emits up to the stop, and the counters said the whole draft
    accepted and a token after it (spec_tokens_per_step 9.0 for a verify step that emitted 2)."""
    def request(context: tuple[DraftContext, ...] = (), stop: tuple[int, ...] = ()) -> Request:
        return Request(id="a", prompt_ids=[7, 8, 9, 10, 11, 12, 13], draft_context=context, params=SamplingParams(
            max_new_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=stop))

    full = generate(engine(qwen2_dir), [request()])["a"].token_ids
    eng = engine(qwen2_dir, speculative="on", spec_max_tokens=8)
    out = generate(eng, [request((DraftContext(source="epoch", token_ids=tuple(full)),), (full[at],))])["a"]
    stats = eng.stats().spec
    assert out.finish_reason == "stop" and len(out.token_ids) == full.index(full[at]) + 1
    rows, accepted = sum(stats.num_drafts.values()), sum(stats.num_accepted_tokens.values())
    assert accepted + rows == len(out.token_ids) - 1  # the first token is the prefill's


def test_auto_speculates_where_the_measured_cost_says_it_pays(qwen2_dir):
    """``auto`` verifies drafts only with at most ``max_rows`` running (4 in a hand-made table, so
    only the last group of three; in a measured one, whatever it says), tokens unchanged; without a table it measures
    one at its first step, with the requests already queued set aside and the counters left alone."""
    plain, _ = run(engine(qwen2_dir), sibling_requests())
    context = {k: tuple(o.token_ids) for k, o in plain.items()}
    cheap_up_to_4 = SpecCost((1, 4, 8), (0, 1, 2, 4), ((1, 1.1, 1.2, 1.4), (1.2, 1.3, 1.4, 1.6), (2, 5, 8, 14)))
    assert cheap_up_to_4.max_rows == 4
    eng = TorchEngine(load_model(qwen2_dir), EngineConfig(block_size=4, speculative="auto"), spec_cost=cheap_up_to_4)
    spec, trace = run(eng, sibling_requests(context))
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert any(v for _, v in trace) and all(n <= 4 for n, v in trace if v), trace
    measured = engine(qwen2_dir, speculative="auto", spec_max_tokens=2, max_num_seqs=2)
    spec, _ = run(measured, sibling_requests(context))
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert (measured.spec_cost.rows, measured.spec_cost.draft_lens) == ((1, 2), (0, 1, 2))
    assert measured.stats().num_generated_tokens == sum(len(o.token_ids) for o in plain.values())
    assert "forced" not in measured.stats().spec.num_drafts  # the calibration's own drafts


def test_auto_calibrates_within_a_short_context_or_says_it_cannot(qwen2_dir):
    """The calibration's probe requests finished at a short context mid-measure (a verify step of nothing: an
    index_select error at the run's first step); now it measures fewer steps and draft lengths, or the engine is
    refused as it starts."""
    from rollpacker.rollout.torch_engine.verify import SPEC_COSTS

    SPEC_COSTS.clear()
    eng = engine(qwen2_dir, speculative="auto", max_model_len=32)  # spec_max_tokens 8
    out = generate(eng, [Request(id="a", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=5,
                                                                                      temperature=0))])
    assert len(out["a"].token_ids) == 5 and eng.spec_cost.draft_lens == (0, 1, 8)
    assert sorted(eng.free_blocks) == list(range(eng.num_blocks))
    with pytest.raises(ValueError, match="up to 8 draft tokens .* a 16-token context cannot hold: lower "
                                         "engine.spec_max_tokens"):
        engine(qwen2_dir, speculative="auto", max_model_len=16)


def test_auto_calibrates_within_the_prefill_budget_and_the_kv_cache_or_says_it_cannot(qwen2_dir):
    """The calibration expected every probe request prefilled in one step and its prompt to fit the context
    alone: under a smaller engine.max_prefill_tokens ("30 running, expected 32") or KV cache (a probe request
    refused) an engine that serves with speculative off died at its first step with auto."""
    from rollpacker.rollout.torch_engine.verify import SPEC_COSTS

    request = Request(id="a", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=5, temperature=0))
    plain = generate(engine(qwen2_dir), [request])["a"].token_ids
    # the last: a block holds the probe's new tokens, and the spare block per running request limits the rows
    for settings in ({"max_prefill_tokens": 100, "spec_max_tokens": 2}, {"kv_memory_mb": 0.07},
                     {"block_size": 64, "kv_memory_mb": 0.25, "max_model_len": 300, "spec_max_tokens": 2}):
        SPEC_COSTS.clear()
        eng = engine(qwen2_dir, speculative="auto", **settings)
        assert generate(eng, [request])["a"].token_ids == plain, settings
        assert sorted(eng.free_blocks) == list(range(eng.num_blocks))
    with pytest.raises(ValueError, match="up to 8 draft tokens .* a KV cache of 12 tokens .* cannot hold"):
        engine(qwen2_dir, speculative="auto", kv_memory_mb=0.006)


def test_the_probes_run_no_more_rows_than_the_engine_holds_and_no_empty_prompt(qwen2_dir):
    """The planner's profile asked the speculation probe for 32 rows of an engine of fewer ("16 running, expected
    32"); a ragged decode probe at a 2-token context made an empty prompt."""
    from rollpacker.rollout.probe import decode_step_ms, measure_spec_cost

    eng = engine(qwen2_dir, max_num_seqs=4)
    assert max(measure_spec_cost(eng, 32, 2, 16, steps=2).rows) == 4
    assert len(decode_step_ms(eng, 4, 2, eng.vocab_size, set(), 2, seed=0, ragged=200)) == 2
    assert sorted(eng.free_blocks) == list(range(eng.num_blocks))


def test_a_budget_that_holds_no_kv_block_is_a_config_error(qwen2_dir):
    """It was a ValueError, each rank's traceback, not the one line of a config error."""
    from rollpacker.errors import UserError

    with pytest.raises(UserError, match=r"engine.memory_mb=0.01 \(this rank's weights: .* MiB\) holds no .*: raise "
                                        r"engine.memory_mb"):
        engine(qwen2_dir, memory_mb=0.01)


@pytest.mark.parametrize("verify_s", [1.0, 20.0])
def test_auto_backs_off_where_drafting_does_not_pay(qwen2_dir, verify_s):
    """The cost table says drafts pay (cheap verify steps up to 4 running) and every request is offered
    its own response as an earlier epoch's. When a verify step takes 20x a plain step (at most 5 tokens
    per row for 20x the time), ``auto`` measures that, backs off and, four batches on, drafts nothing;
    when it takes as long as a plain step, it drafts to the end. Tokens unchanged either way."""
    reqs = lambda b: [Request(id=f"b{b}-{i}", prompt_ids=p, params=SamplingParams(  # noqa: E731
        max_new_tokens=150, temperature=0, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    plain = generate(engine(qwen2_dir), reqs(0))
    context = [(DraftContext(source="epoch", token_ids=tuple(plain[f"b0-{i}"].token_ids)),) for i in range(3)]
    cheap_up_to_4 = SpecCost((1, 4, 8), (0, 1, 2, 4), ((1, 1.1, 1.2, 1.4), (1.2, 1.3, 1.4, 1.6), (2, 5, 8, 14)))
    clock = StepClock(verify_s)
    eng = TorchEngine(load_model(qwen2_dir), EngineConfig(block_size=4, speculative="auto", spec_max_tokens=4),
                      spec_cost=cheap_up_to_4, clock=clock)
    clock.engine = eng
    verify_steps = []
    for b in range(4):
        before = eng.stats().spec.num_verify_steps
        out = generate(eng, [dataclasses.replace(r, draft_context=c) for r, c in zip(reqs(b), context)])
        assert {k[3:]: o.token_ids for k, o in out.items()} == {k[3:]: o.token_ids for k, o in plain.items()}
        verify_steps.append(eng.stats().spec.num_verify_steps - before)
    if verify_s > 1:
        assert verify_steps[0] > 0 and verify_steps[-1] == 0 and eng.realized.num_backoffs >= 2, verify_steps
    else:
        assert all(verify_steps) and eng.realized.num_backoffs == 0, verify_steps


def test_auto_counts_asking_for_drafts_as_drafting(qwen2_dir):
    """Asking the drafter costs a step even when no draft comes of it (here 4 s on a 1 s step, verifying
    free, no earlier epoch offered): those steps count as drafted, not as plain, so ``auto`` compares
    them with steps that did not ask, backs off, and asks in few steps of the last batch."""
    reqs = lambda b: [Request(id=f"b{b}-{i}", prompt_ids=p, params=SamplingParams(  # noqa: E731
        max_new_tokens=150, temperature=0, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    plain = generate(engine(qwen2_dir), reqs(0))
    cheap_up_to_4 = SpecCost((1, 4, 8), (0, 1, 2, 4), ((1, 1.1, 1.2, 1.4), (1.2, 1.3, 1.4, 1.6), (2, 5, 8, 14)))
    clock = StepClock(1.0, propose_s=4.0)
    eng = TorchEngine(load_model(qwen2_dir), EngineConfig(block_size=4, speculative="auto", spec_max_tokens=4),
                      spec_cost=cheap_up_to_4, clock=clock)
    clock.engine = eng
    asked = []
    for b in range(4):
        before = eng.num_proposing_steps
        out = generate(eng, reqs(b))
        assert {k[3:]: o.token_ids for k, o in out.items()} == {k[3:]: o.token_ids for k, o in plain.items()}
        asked.append(eng.num_proposing_steps - before)
    assert eng.realized.num_backoffs >= 2 and asked[-1] < asked[0] / 2, (asked, eng.realized.num_backoffs)
    spec = eng.stats().spec  # every request of every step that asked was asked, and the asking timed
    assert spec.num_asked >= sum(asked) > 0 and spec.draft_seconds > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen2_dir):
    first = generate(engine(qwen2_dir), sampled_requests())
    # a different batch composition and cache pressure: same samples
    eng = engine(qwen2_dir, kv_memory_mb=0.07, max_num_seqs=3)
    second = generate(eng, sampled_requests()[::-1])
    assert {k: o.token_ids for k, o in first.items()} == {k: o.token_ids for k, o in second.items()}
    greedy = generate(engine(qwen2_dir), greedy_requests())
    assert any(first[f"s{i}"].token_ids != greedy[f"r{i}"].token_ids for i in range(len(PROMPTS)))
    other_seeds = generate(engine(qwen2_dir), sampled_requests(seed_offset=7))
    assert any(first[k].token_ids != other_seeds[k].token_ids for k in first)


def test_sampled_resume_continues_the_same_draws(qwen2_dir):
    req = sampled_requests()[4]
    whole = generate(engine(qwen2_dir), [req])[req.id]
    eng = engine(qwen2_dir)
    eng.add(req)
    for _ in range(30):
        eng.step()
    partial = eng.abort(req.id)
    resumed = generate(engine(qwen2_dir), [Request(id=req.id, prompt_ids=req.prompt_ids, params=req.params,
                                                    resume_from=partial)])[req.id]
    assert resumed.token_ids == whole.token_ids


def test_top_k_one_is_greedy(qwen2_dir, reference):
    reqs = [Request(id=r.id, prompt_ids=r.prompt_ids, params=SamplingParams(
        max_new_tokens=r.params.max_new_tokens, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
        for r in greedy_requests()]
    assert {k: o.token_ids for k, o in generate(engine(qwen2_dir), reqs).items()} == reference


def test_stop_tokens_and_eos(qwen2_dir, reference):
    stop = reference["r0"][5]
    first = reference["r0"].index(stop)
    out = generate(engine(qwen2_dir), [Request(id="a", prompt_ids=PROMPTS[0], params=SamplingParams(
        max_new_tokens=30, temperature=0, stop_token_ids=(stop,)))])["a"]
    assert out.finish_reason == "stop" and out.token_ids == reference["r0"][: first + 1]
    # EOS ends a request unless ignore_eos: make the model's EOS the token greedy emits first
    eos_model = load_model(qwen2_dir)
    eos_model.args.eos_token_ids = (reference["r3"][0],)
    out = generate(TorchEngine(eos_model), [Request(id="b", prompt_ids=PROMPTS[3], params=SamplingParams(
        max_new_tokens=10, temperature=0))])["b"]
    assert out.finish_reason == "stop" and out.token_ids == reference["r3"][:1]


@pytest.mark.parametrize("stop", ["ab", "答案", "🙂"], ids=["ascii", "cjk", "emoji"])
def test_a_stop_string_is_found_at_the_token_completing_it_however_many_bytes_its_characters_take(stop):
    """The toy tokenizer has a token a byte, as byte-level BPE splits rare characters: 答案 is 6 tokens."""
    from transformers import AutoTokenizer

    from rollpacker.rollout.engine import stop_string_hit, text_decoder
    from rollpacker.toy.model import toy_model_dir

    ids = AutoTokenizer.from_pretrained(toy_model_dir()).encode("hello " + stop + " x", add_special_tokens=False)
    decode = text_decoder(toy_model_dir())
    hits = [n for n in range(1, len(ids) + 1) if stop_string_hit(decode, ids[:n], (stop,))]
    assert hits[0] == len(ids) - 2 == next(n for n in range(len(ids) + 1) if stop in decode(ids[:n]))
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())  # special tokens between its characters: no text
    special = next(i for i in tokenizer.all_special_ids if i != tokenizer.eos_token_id)
    split = ids[:-3] + [special] * 8 + ids[-3:]
    assert stop in decode(split) and stop_string_hit(decode, split[:-2], (stop,))


def test_stop_string_ends_generation_on_the_toy_model():
    """A stop string ends the response at the token completing it; the text is cut before it."""
    from transformers import AutoTokenizer

    from rollpacker.data.chat import cut_at_stop
    from rollpacker.rollout.engine import text_decoder
    from rollpacker.toy import task as toy
    from rollpacker.toy.model import toy_model_dir

    path = toy_model_dir()
    decode = text_decoder(path)
    eng = TorchEngine(load_model(path), EngineConfig(kv_memory_mb=4), decode=decode)
    prompt = AutoTokenizer.from_pretrained(path).encode(toy.make_dataset(1, seed=3)[0]["prompt"])
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    full = generate(eng, [Request(id="full", prompt_ids=prompt, params=params)])["full"].token_ids
    text = decode(full)
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle of the greedy response
    first = next(n for n in range(1, len(full) + 1) if stop in decode(full[:n]))
    out = generate(eng, [Request(id="s", prompt_ids=prompt, params=SamplingParams(**{**vars(params), "stop": (
        "never said", stop)}))])["s"]
    assert out.finish_reason == "stop" and out.token_ids == full[:first] and first < len(full), (text, stop)
    assert cut_at_stop(decode(out.token_ids), ("never said", stop)) == text[:text.index(stop)]
    eng.decode = None
    with pytest.raises(ValueError, match="stop strings need the engine's decoder"):
        eng.add(Request(id="x", prompt_ids=prompt, params=SamplingParams(max_new_tokens=4, stop=("a",))))


def test_context_length_ends_generation(qwen2_dir, reference):
    out = generate(engine(qwen2_dir, max_model_len=50), [greedy_requests()[3]])["r3"]
    assert out.finish_reason == "length" and out.token_ids == reference["r3"][:10]


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(qwen2_dir, reference):
    eng = engine(qwen2_dir, max_model_len=64)
    eng.add(greedy_requests()[0])
    cases = {
        "empty": ([], 5, "prompt is empty"),
        "too-long": (list(range(64)), 5, "context length 64"),
        "zero-new": ([1, 2], 0, "max_new_tokens=0"),
        "bad-token": ([1, 500], 5, "outside the vocabulary"),
    }
    for rid, (prompt, n, msg) in cases.items():
        with pytest.raises(ValueError, match=f"'{rid}'.*{msg}"):
            eng.add(Request(id=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=n)))
    with pytest.raises(ValueError, match="already queued"):
        eng.add(greedy_requests()[0])
    with pytest.raises(ValueError, match="'ctx'.*source 'sibling'"):
        eng.add(Request(id="ctx", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=3),
                        draft_context=(DraftContext(source="sibling", token_ids=(1,)),)))
    with pytest.raises(ValueError, match="raise engine.kv_memory_mb"):
        engine(qwen2_dir, kv_memory_mb=0.01).add(greedy_requests()[2])
    with pytest.raises(ValueError, match="engine.block_size"):
        EngineConfig(block_size=0)
    assert generate(eng, [])["r0"].token_ids == reference["r0"]


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_update_weights_and_memory_release(qwen2_dir, qwen3_tied_dir, tmp_path, speculative):
    from support.models import make_hf_model

    other_dir = make_hf_model(tmp_path / "other", "qwen2", initializer_range=0.05)
    eng = engine(qwen2_dir, speculative=speculative)
    target = generate(engine(other_dir), greedy_requests())
    eng.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.step()
    eng.update_weights(load_model(other_dir).state_dict().items())
    eng.resume_memory()
    assert {k: o.token_ids for k, o in generate(eng, greedy_requests()).items()} == \
        {k: o.token_ids for k, o in target.items()}
    eng.add(greedy_requests()[0])
    with pytest.raises(RuntimeError, match="1 waiting"):
        eng.release_memory()
    with pytest.raises(KeyError, match="not a parameter"):
        eng.update_weights([("layers.9.mlp.up_proj.weight", torch.zeros(1))])
    # a push that leaves a parameter out kept its old weights; a broadcastable shape filled it: both unsaid
    eng.abort(greedy_requests()[0].id)
    weights = load_model(other_dir).state_dict()
    with pytest.raises(KeyError, match=r"no tensor for 1 of the engine's parameters, e.g. norm.weight"):
        eng.update_weights((k, v) for k, v in weights.items() if k != "norm.weight")
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(1,\), the engine's \(\d+,\)"):
        eng.update_weights({**weights, "norm.weight": torch.ones(1)}.items())


def test_engine_rms_norm_is_the_models():
    from rollpacker.model.transformer import RMSNorm
    from rollpacker.rollout.torch_engine.layout import rms_norm as _rms_norm

    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 64), (37, 96), (5, 4, 16)]:
        norm = RMSNorm(shape[-1], eps=1e-6)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=gen)
            x = torch.randn(shape, generator=gen) * 3
            assert torch.equal(_rms_norm(x, norm.weight, norm.eps), norm(x))


def test_pushed_weights_arrive_in_the_engines_dtype(toy_random_dir):
    """Issue 37: the trainer's fp32 masters reach a bf16 engine as bf16 (hf_names converts for vLLM and
    SGLang; TorchEngine copies into its own parameters), equal to the masters rounded once."""
    from rollpacker.rollout.engine import hf_names

    masters = load_model(toy_random_dir)
    named = list(masters.named_parameters())
    pushed = dict(hf_names(named, tied=masters.args.tie_word_embeddings, dtype=torch.bfloat16))
    assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
    assert torch.equal(pushed["model.norm.weight"], masters.norm.weight.detach().bfloat16())
    assert {t.dtype for _, t in hf_names(named, tied=False)} == {torch.float32}  # no dtype: as they are
    with torch.no_grad():
        for p in masters.parameters():
            p.add_(0.01)
    engine = TorchEngine(load_model(toy_random_dir, dtype=torch.bfloat16))
    engine.update_weights(masters.named_parameters())
    mine = dict(engine.model.named_parameters())
    for name, p in masters.named_parameters():
        assert mine[name].dtype == torch.bfloat16 and torch.equal(mine[name], p.detach().bfloat16()), name


def test_pytorchs_cuda_cache_is_emptied_before_vllm_takes_memory_back(monkeypatch):
    """Issue 37: vLLM's wake-up allocates from its own cuMem pool, beside PyTorch's cache, which still holds
    the trainer's freed activations unless emptied first (TRL, verl). The order on GPU, with a recording
    stand-in for vLLM's sleep-mode engine (sleep mode runs on CUDA only)."""
    from types import SimpleNamespace

    from rollpacker.rollout import engine as contract
    from rollpacker.rollout.vllm_engine import VLLMEngine

    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    assert contract.free_cached_memory() and calls == ["empty_cache"]
    calls.clear()
    vllm = SimpleNamespace(wake_up=lambda tags=None: calls.append(f"wake_up {tags}"),
                           sleep=lambda level: calls.append(f"sleep {level}"),
                           reset_prefix_cache=lambda: calls.append("reset_prefix_cache") or True,
                           collective_rpc=lambda method, kwargs: calls.append(
                               f"{method} {sorted({t.dtype for _, t in kwargs['weights_iterator']})}"))
    engine = object.__new__(VLLMEngine)
    vars(engine).update(engine=vllm, on_cpu=False, live={}, released=False, weights_awake=False, tied=False,
                        moe=False, dtype=torch.bfloat16, to_checkpoint=lambda named: named)
    engine.release_memory()
    engine.update_weights([("layers.0.mlp.up_proj.weight", torch.ones(2))])  # an fp32 master
    engine.resume_memory()
    assert calls == ["sleep 1", "reset_prefix_cache", "empty_cache", "wake_up ['weights']",
                     "reload_weights [torch.bfloat16]", "reset_prefix_cache", "empty_cache", "wake_up ['kv_cache']"]
    # a RolloutPipe training rank: released, a push wakes the weights, released again: the weights went back
    # (they stayed on the GPU while it trained), and all wakes up; released twice, nothing sleeps twice
    calls.clear()
    engine.release_memory()
    engine.update_weights([("layers.0.mlp.up_proj.weight", torch.ones(2))])
    engine.release_memory()
    engine.release_memory()
    engine.resume_memory()
    assert calls == ["sleep 1", "reset_prefix_cache", "empty_cache", "wake_up ['weights']",
                     "reload_weights [torch.bfloat16]", "reset_prefix_cache", "sleep 1", "reset_prefix_cache",
                     "empty_cache", "wake_up None"]
    vllm.reset_prefix_cache = lambda: False  # vLLM could not: the next round would reuse the old weights' KV
    with pytest.raises(RuntimeError, match="did not reset its prefix cache after a weight push"):
        engine.update_weights([("layers.0.mlp.up_proj.weight", torch.ones(2))])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not contract.free_cached_memory()  # CPU: nothing to empty


def test_a_near_uniform_row_draws_the_same_token_when_its_probabilities_move_in_the_last_bits():
    """What shares a row's batch moves its logits in the last bits. On a near-uniform row (the toy model far
    past its training contexts) that reorders a descending-probability walk, and most draws land on another
    token; walked in vocabulary order, the draws stay. The truncation and the frequencies are top-k/top-p's."""
    from rollpacker.rollout.torch_engine.sampling import sample

    g = torch.Generator().manual_seed(0)
    rows, vocab = 256, 256
    logits = torch.randn(rows, vocab, generator=g) * 1e-3
    moved = logits + torch.randn(rows, vocab, generator=g) * 1e-6
    u, everything = torch.rand(rows, generator=g), (torch.full((rows,), vocab), torch.ones(rows))
    drawn = sample(torch.log_softmax(logits, -1), *everything, u)
    assert torch.equal(drawn, sample(torch.log_softmax(moved, -1), *everything, u))
    assert len(set(drawn.tolist())) > vocab // 2  # the draws spread over the row
    peaked = torch.log_softmax(torch.tensor([[0.0, 3.0, 2.0, 1.0, 2.9]]), -1).expand(20000, 5)
    draws = sample(peaked, torch.full((20000,), 2), torch.full((20000,), 0.99), torch.rand(20000, generator=g))
    share = (draws == 1).float().mean().item()
    assert set(draws.tolist()) == {1, 4} and abs(share - 1 / (1 + torch.e ** -0.1)) < 0.01  # the top two, renormalized


def test_repetition_penalty_is_transformers_and_min_p_keeps_every_invariant(qwen2_dir):
    """Greedy under a repetition penalty takes transformers' ``generate`` tokens, and log-probs stay the
    model's own. Sampled rows with a penalty and min-p draw the same tokens whatever their batch, cache
    pressure (preempted and recomputed) or speculation (drafts verified with the penalty they would see)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    reqs = greedy_requests(repetition_penalty=1.5)
    got = generate(engine(qwen2_dir), reqs)
    for r in reqs:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([r.prompt_ids]), max_new_tokens=r.params.max_new_tokens, do_sample=False,
                              repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)[0, len(r.prompt_ids):]
            logits = hf(ids[None, :0].new_tensor([r.prompt_ids + ids.tolist()])).logits[0, len(r.prompt_ids) - 1:-1]
        assert got[r.id].token_ids == ids.tolist(), r.id
        own = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(got[r.id].logprobs), own, atol=1e-4, rtol=0)
    assert got != generate(engine(qwen2_dir), greedy_requests())

    def penalized(draft_context=None):
        return [dataclasses.replace(r, params=dataclasses.replace(r.params, repetition_penalty=1.3 + 0.2 * (i % 2),
                                                                  min_p=0.05 * (i % 3)))
                for i, r in enumerate(sibling_requests(draft_context)) if r.params.temperature > 0]

    plain, _ = run(engine(qwen2_dir), penalized())
    pressed = generate(engine(qwen2_dir, kv_memory_mb=0.05, max_num_seqs=3), penalized()[::-1])
    eng = engine(qwen2_dir, speculative="on", spec_max_tokens=4)
    spec, _ = run(eng, penalized({k: tuple(o.token_ids) for k, o in plain.items()}))
    assert eng.stats().spec.num_verify_steps > 0 and eng.num_preemptions == 0
    for k, o in plain.items():
        assert spec[k].token_ids == pressed[k].token_ids == o.token_ids, k
        torch.testing.assert_close(spec[k].logprobs, o.logprobs, rtol=0, atol=1e-5, msg=k)
    unpenalized, _ = run(engine(qwen2_dir), [r for r in sibling_requests() if r.params.temperature > 0])
    assert any(unpenalized[k].token_ids != o.token_ids for k, o in plain.items())


def test_min_p_then_top_k_then_top_p_over_what_they_keep():
    """vLLM's and Hugging Face's order: min-p and top-k cut, then top-p walks the mass they kept, renormalized."""
    from rollpacker.rollout.torch_engine.sampling import sample

    g, n = torch.Generator().manual_seed(0), 20000
    u = torch.rand(n, generator=g)

    def shares(probs, top_k, top_p, min_p):
        rows = torch.tensor(probs).log().expand(n, len(probs))
        full = torch.full((n,), 1.0)
        drawn = sample(rows, (full * (top_k or len(probs))).long(), full * top_p, u, full * min_p)
        return torch.bincount(drawn, minlength=len(probs)).float() / n

    # top-2 keeps 0.4 and 0.35; renormalized, 0.4 alone is past top-p 0.5 (over the whole row both would be)
    assert shares([0.4, 0.35, 0.25], 2, 0.5, 0).tolist() == [1, 0, 0]
    # min-p 0.25 of the likeliest 0.5 keeps what is at least 0.125, in proportion
    got = shares([0.5, 0.05, 0.3, 0.15], 0, 1.0, 0.25)
    torch.testing.assert_close(got, torch.tensor([0.5, 0, 0.3, 0.15]) / 0.95, atol=0.01, rtol=0)
    assert got[1] == 0
