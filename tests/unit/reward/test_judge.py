"""The LLM judge: verdict parsing, the choice of resident layers, layer-wise offloading equal to
the resident model bit for bit (CPU; overlap on GPU), and a reward model's scores against transformers'.

The toy model stands in for a judge: it adds single digits, so with the rubric ``ADDER`` its
verdict on the pair ("3", "4") is the token "7".
"""

from __future__ import annotations

import re

import pytest
import torch

from rollpacker.model import CausalAttention, ModelArgs, Transformer, load_model
from rollpacker.reward.judge import (
    Judge,
    JudgeConfig,
    OffloadedLayers,
    activation_bytes_per_token,
    choose_resident_layers,
    parse_verdict,
)
from rollpacker.reward.rules import RewardError
from rollpacker.toy.model import toy_model_dir

ADDER = "Q: {prompt}+{response}\nA: {prompt}+{response}="
PAIRS = [("3", "4"), ("2", "5"), ("1", "1"), ("40", "6"), ("8", "1+2+3+4+5+6+7+8+9-9-8-7-6")]


def toy_judge(**overrides) -> Judge:
    return Judge(JudgeConfig(model_path=str(toy_model_dir()), rubric=ADDER, **overrides))


def packed(seqs: list[list[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions [T] and the index of each sequence's last token [N]."""
    lens = torch.tensor([len(s) for s in seqs])
    tokens = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()]).to(device)
    return tokens, positions, (lens.cumsum(0) - 1).to(device)


def resident_logits(model: Transformer, seqs: list[list[int]]) -> torch.Tensor:
    """The resident path: the whole model on its device, through ``Transformer.forward``."""
    device = model.embed_tokens.weight.device
    tokens, positions, last = packed(seqs, device)
    with torch.inference_mode():
        hidden = model(tokens, positions, CausalAttention([len(s) for s in seqs], device))
        return model.logits(hidden[last])


def offloaded_hidden(layers: OffloadedLayers, model: Transformer, seqs: list[list[int]]) -> torch.Tensor:
    """The offloaded path over ``layers`` with ``model``'s embedding and final norm (all tokens)."""
    from rollpacker.model.transformer import rope_cos_sin

    device = layers.device
    tokens, positions, _ = packed(seqs, device)
    with torch.inference_mode():
        x = model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, model.inv_freq, x.dtype)
        return model.norm(layers(x, cos, sin, CausalAttention([len(s) for s in seqs], device)))


# --- verdicts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("verdict, reward", [("7", 7 / 9), (" 3\n", 3 / 9), ("0", 0.0), ("9", 1.0)])
def test_parse_verdict_accepts_integers_in_range(verdict, reward):
    assert parse_verdict(verdict, 9) == reward


@pytest.mark.parametrize("verdict", ["", " ", "seven", "-1", "7.5", "<|endoftext|>", "\u0663", "Score: 7"])
def test_parse_verdict_rejects_non_scores(verdict):
    with pytest.raises(RewardError, match="is not a score: expected an integer from 0 to 9"):
        parse_verdict(verdict, 9)


def test_parse_verdict_rejects_out_of_range():
    with pytest.raises(RewardError, match="verdict 6 is out of range: expected an integer from 0 to 5"):
        parse_verdict("6", 5)


# --- choosing K -------------------------------------------------------------------------------

SIZES = dict(num_layers=4, layer_bytes=100, fixed_bytes=50, num_tokens=10, bytes_per_token=5)  # activations: 50


@pytest.mark.parametrize("budget, k", [
    (500, 4),  # room 400 = 4 layers: all resident, no buffers
    (10_000, 4),
    (499, 1),  # room 399: 3 layers' worth = 1 resident + 2 buffers (3 resident would need 400)
    (400, 1),  # room 300
    (399, 0),  # room 299
    (300, 0),  # room 200: both buffers, nothing resident
])
def test_choose_resident_layers(budget, k):
    assert choose_resident_layers(**SIZES, budget_bytes=budget) == k


def test_choose_resident_layers_says_what_to_do_when_nothing_fits():
    with pytest.raises(RewardError, match=r"batch of 10 tokens .* lower judge.max_batch_tokens"):
        choose_resident_layers(**SIZES, budget_bytes=299)


def test_a_judge_on_cpu_names_its_memory_setting_when_nothing_fits():
    with pytest.raises(RewardError, match=r"lower judge.max_batch_tokens or raise judge.cpu_memory_gib"):
        toy_judge(cpu_memory_gib=1e-6).num_resident_for([40])


def test_activation_bytes_per_token():
    args = ModelArgs.from_hf(dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4))
    # 4 * 8 (hidden) + 6 * (2 + 2 * 1) * 4 (q, k, v) + 3 * 16 (intermediate) = 32 + 96 + 48 elements
    assert activation_bytes_per_token(args, torch.bfloat16) == 176 * 2


# --- offloading equals the resident path, bit for bit ------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_judge_offloaded_equals_resident_bitwise(k):
    judge = toy_judge(resident_layers=k)
    seqs = [judge.encode(p, r) for p, r in PAIRS]
    logits = judge.last_logits(seqs)
    assert judge.layers.num_resident == k and len(judge.layers.buffers) == min(2, 4 - k)
    assert torch.equal(logits, resident_logits(load_model(toy_model_dir()), seqs))
    assert torch.equal(judge.last_logits(seqs), logits)  # the reused buffers hold no stale state


@pytest.mark.parametrize("model_dir", ["qwen2_dir", "qwen3_tied_dir"])
def test_offloaded_layers_equal_resident_bitwise(model_dir, request):
    model = load_model(request.getfixturevalue(model_dir))
    seqs = [[5, 7, 9, 11], list(range(1, 40)), [3]]
    ref = resident_logits(model, seqs)
    layers = OffloadedLayers(list(model.layers), model.args, "cpu")
    _, _, last = packed(seqs)
    for k in range(len(layers) + 1):
        layers.set_resident(k)
        assert torch.equal(model.logits(offloaded_hidden(layers, model, seqs)[last]), ref), f"K={k}"


def test_auto_k_follows_the_batch_length():
    judge = toy_judge()
    layer, per_token = judge.layers.layer_bytes, judge.bytes_per_token
    short = [judge.encode(p, r) for p, r in PAIRS[:2]]
    long = short + [judge.encode("1", "1" * (layer // per_token // 2))]  # ADDER has it twice: one layer more

    def fixed(seqs):  # weights outside the layers, logits and activations
        return judge.fixed_bytes + len(seqs) * judge.model.args.vocab_size * 4 + sum(map(len, seqs)) * per_token

    # room for 3.5 layers with the short batch: K = 3 - 2 = 1; about 2.5 with the long one: K = 0
    assert 0.5 * layer < fixed(long) - fixed(short) < 1.5 * layer
    judge.cfg.cpu_memory_gib = (fixed(short) + 3.5 * layer) / 2**30
    reference = load_model(toy_model_dir())
    for seqs, k in [(short, 1), (long, 0), (short, 1)]:
        logits = judge.last_logits(seqs)
        assert judge.layers.num_resident == k
        assert torch.equal(logits, resident_logits(reference, seqs))
    judge.cfg.cpu_memory_gib = 100 * 2**30  # plenty: everything resident
    judge.last_logits(long)
    assert judge.layers.num_resident == 4 and judge.layers.buffers == []


# --- scoring ----------------------------------------------------------------------------------


def test_score_reads_the_verdict_token():
    judge = toy_judge(resident_layers=0)
    assert judge.score(PAIRS[:3]) == [7 / 9, 7 / 9, 2 / 9]


def test_score_flags_bad_verdicts_per_pair():
    judge = toy_judge(max_score=7, max_tokens=20)
    results = judge.score([("3", "4"), ("4", "4"), ("3", "4" * 20)])
    assert results[0] == 1.0
    assert isinstance(results[1], RewardError) and "verdict 8 is out of range" in str(results[1])
    assert isinstance(results[2], RewardError) and "over judge.max_tokens=20" in str(results[2])
    # an empty input (a rubric of only {prompt}{response}, both empty) is its own error, not a neighbour's verdict
    empty, alone = judge.score_ids([[], judge.encode("3", "4")])
    assert isinstance(empty, RewardError) and "judge input is empty" in str(empty) and alone == 1.0
    unparseable = Judge(JudgeConfig(model_path=str(toy_model_dir()), rubric="Q: {prompt}+{response}\nA:"))
    [result] = unparseable.score([("3", "4")])  # the toy model answers " 3+4=7": a space comes first
    assert isinstance(result, RewardError) and "verdict ' ' is not a score" in str(result)


def test_score_packs_batches_and_flags_what_does_not_fit():
    judge = toy_judge(max_tokens=40, max_batch_tokens=40)  # one pair per forward
    assert judge.score(PAIRS[:3]) == toy_judge().score(PAIRS[:3])
    judge.cfg.cpu_memory_gib = 1e-6
    assert all(isinstance(r, RewardError) and "lower judge.max_batch_tokens" in str(r) for r in judge.score(PAIRS[:4]))


# --- a reward model ----------------------------------------------------------------------------

RM_SAMPLES = [("1+2", "3", None), ([{"role": "user", "content": "2+5"}], "8", None),
              ("4+4", "", [{"role": "assistant", "content": "9"}, {"role": "user", "content": "wrong"},
                           {"role": "assistant", "content": "8"}])]
"""(prompt, response, an episode's turns): a string prompt, chat messages, a multi-turn episode."""


def test_a_reward_model_scores_the_conversation_as_transformers_does(reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    judge = Judge(JudgeConfig(model_path=str(reward_model_dir)))
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    seqs, expected = [], []
    for prompt, response, turns in RM_SAMPLES:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages + (turns or [{"role": "assistant", "content": response}]),
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert judge.encode(prompt, response, None, turns) == ids  # the conversation in the RM's own template
        seqs.append(ids)
        with torch.no_grad():
            expected.append(reference(torch.tensor([ids])).logits[0, 0].item())
    scores = judge.score_ids(seqs)  # one packed forward
    assert scores == pytest.approx(expected, abs=1e-5) and len(set(scores)) == 3
    streamed = Judge(JudgeConfig(model_path=str(reward_model_dir), resident_layers=0))
    assert streamed.score_ids(seqs) == scores  # every layer streamed from host memory: the same, bit for bit
    # a rubric is a generative judge's: a reward model takes none, and max_score does not bind it
    assert Judge(JudgeConfig(model_path=str(reward_model_dir), rubric=ADDER, max_score=99)).score_ids(seqs) == scores
    judge.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no "
                                     "tool') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    tool_first = [{"role": "tool", "content": "x"}, {"role": "user", "content": "1+2"}]
    good, refused = judge.score([("1+2", " 3"), (tool_first, " 3")])  # one pair's refusal is its own error
    assert good == judge.score_ids([judge.encode("1+2", " 3")])[0] and isinstance(refused, RewardError)
    judge.tokenizer.chat_template = None  # without a template: the prompt's text and the response's, as TRL joins them
    assert judge.encode("Q: 1+2\nA:", " 3") == tokenizer("Q: 1+2\nA: 3", add_special_tokens=False)["input_ids"]
    pad = tokenizer.pad_token_id  # scored after the last token that is not padding, as Hugging Face reads it
    assert judge.encode("1+2", " 3<|pad|><|pad|>") == judge.encode("1+2", " 3") != []
    assert pad in tokenizer("<|pad|>", add_special_tokens=False)["input_ids"]


def test_a_reward_model_scores_a_prefill_inside_the_answer_and_no_number_as_an_error(reward_model_dir, tmp_path):
    """A prompt ending in an assistant prefill is one assistant turn with the response (as TRL scores it, and as
    our reward functions get it), not two; a score that is not a number (a float16 overflow) is the response's
    reward error, never a reward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    judge = Judge(JudgeConfig(model_path=str(reward_model_dir)))
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    prefilled = [{"role": "user", "content": "2+5"}, {"role": "assistant", "content": "The answer is "}]
    one_turn = tokenizer.apply_chat_template([prefilled[0], {"role": "assistant", "content": "The answer is 7"}],
                                             tokenize=False)
    assert judge.encode(prefilled, "7") == tokenizer(one_turn, add_special_tokens=False)["input_ids"]
    overflowing = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    with torch.no_grad():
        overflowing.score.weight.mul_(1e6)  # its scores pass float16's 65504
    overflowing.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    judge = Judge(JudgeConfig(model_path=str(tmp_path), dtype="float16"))
    [error] = judge.score_ids([judge.encode("1+2", "3")])
    assert isinstance(error, RewardError) and re.match(r"the reward model scored -?inf, not a reward", str(error))


def test_the_default_rubric_asks_for_max_scores_range(tmp_path):
    assert "from 0 (wrong or missing) to 5 (fully correct)" in JudgeConfig(max_score=5).rubric
    assert "to 9 (fully correct)" in JudgeConfig().rubric
    assert JudgeConfig(rubric=ADDER, max_score=5).rubric == ADDER
    # a flag's max_score over a preset's: tyro rebuilds the config from the preset's, rubric (of 0..5) included
    from rollpacker.config import parse

    preset = tmp_path / "p.toml"
    preset.write_text("[reward.judge]\nmax_score = 5\n")
    rubric = parse(["--preset", str(preset), "--reward.judge.max-score", "4"]).reward.judge.rubric
    assert "from 0 (wrong or missing) to 4 (fully correct)" in rubric


@pytest.mark.parametrize("overrides, match", [
    (dict(rubric="{prompt} only"), "must contain {response}"),
    (dict(rubric="{prompt} {response} {x}"), "not a valid template"),
    (dict(rubric="{prompt} {response} {"), "not a valid template"),
    (dict(rubric="{{prompt}} {response}"), "must contain {prompt}"),  # doubled braces are literal text
    (dict(rubric="{prompt.upper} {response}"), "not a valid template"),
    (dict(max_score=0), "judge.max_score must be >= 1"),
    (dict(resident_layers=-2), "judge.resident_layers"),
    (dict(max_batch_tokens=10, max_tokens=20), "judge.max_batch_tokens"),
    (dict(memory_fraction=0.0), "judge.memory_fraction"),
    (dict(dtype="fp8"), "judge.dtype"),
])
def test_config_names_the_bad_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        JudgeConfig(**overrides)


def test_judge_refuses_multi_token_scores_and_too_many_layers():
    from rollpacker.reward.config import RewardConfig
    from rollpacker.reward.scheduler import build_functions

    with pytest.raises(ValueError, match="'10' is several tokens.*judge.max_score=9"):
        toy_judge(max_score=10)
    # as reward.funcs is read, before the run starts (the judge loads at its first batch, after a rollout)
    judge = JudgeConfig(model_path=str(toy_model_dir()), rubric=ADDER, max_score=10)
    with pytest.raises(ValueError, match="reward.judge.max_score=10: '10' is several tokens"):
        build_functions(RewardConfig(funcs=("judge",), judge=judge))
    with pytest.raises(ValueError, match="judge.resident_layers=5 but the judge has 4 layers"):
        toy_judge(resident_layers=5)


# --- GPU: prefetch overlaps compute -------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (layer streaming on a side stream)"
)


@pytest.mark.gpu
@needs_cuda
def test_gpu_prefetch_overlaps_compute_and_matches_resident(tmp_path):
    """The GPU check's stage (g) (rollpacker.gpu_check): 6 layers of 2048 hidden, 8192 tokens, so a layer's
    compute is about as long as its copy; more than half the shorter of the two hidden, logits bit-equal."""
    from rollpacker.gpu_check.stages import SIZES, StageRun, stage_judge

    run = StageRun("cuda", tmp_path, tmp_path, SIZES["cuda"], deadline=float("inf"))
    assert stage_judge(run) and run.result["bit_equal"] and run.result["overlap_over_half"], run.result


@pytest.mark.gpu
@needs_cuda
def test_gpu_judge_offloaded_equals_resident():
    scores = {}
    for k in (0, 1, 4):
        judge = Judge(JudgeConfig(model_path=str(toy_model_dir()), rubric=ADDER, resident_layers=k), "cuda")
        seqs = [judge.encode(p, r) for p, r in PAIRS]
        scores[k] = (judge.last_logits(seqs), judge.score(PAIRS))
        assert torch.equal(scores[k][0], resident_logits(load_model(toy_model_dir(), "cuda"), seqs))
    assert scores[0][1] == scores[1][1] == scores[4][1]


# --- launch/mps.sh ----------------------------------------------------------------------------
