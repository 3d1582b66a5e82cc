"""LoRA (train.lora) on a real one-rank FSDP2 trainer: PEFT's LoRA linears in the native decoder and
in a Hugging Face one, the merged weights the engines get, the adapters-off reference and the export."""

from __future__ import annotations

import pytest
import torch

from rollpacker.model import CausalAttention

PROMPT = [3, 9, 4, 17, 22, 5]


def lora_trainer(path, impl: str = "native", **train):
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.model.config import LoraConfig
    from rollpacker.model.hf_decoder import load_hf
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    meshes = build_meshes(1, 0)
    cfg = TrainConfig(lr=5e-2, warmup_steps=0, lora=LoraConfig(rank=4, alpha=8), **train)
    torch.manual_seed(0)
    model = load_model(path) if impl == "native" else load_hf(path)
    return Trainer(model, cfg, meshes.train, num_steps=4)


def batch() -> list:
    from rollpacker.train.trainer import Sample

    return [Sample(PROMPT, [8, 30, 2, 11], 1.0, [-1.0] * 4), Sample(PROMPT, [40, 6, 6], 0.0, [-1.0] * 3),
            Sample(PROMPT, [12, 7], 0.5, [-1.0] * 2)]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def logits(model, tokens: list[int]) -> torch.Tensor:
    t = torch.tensor(tokens)
    with torch.no_grad():
        return model(t, torch.arange(len(t)), CausalAttention([len(t)]), head=lambda h, w: (h @ w.T).float())


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_lora_starts_at_the_base_and_trains_the_adapters_alone(qwen2_dir, impl):
    """(The 2-rank script tests/dist/scripts/lora_step.py also exports both and loads them in peft.)"""
    from rollpacker.model import lora

    trainer = lora_trainer(qwen2_dir, impl)
    base = {name: full(p) for name, p in lora.merged_weights(trainer.model)}
    before = {name: full(p) for name, p in trainer.model.named_parameters()}
    for name, p in trainer.model.named_parameters():
        assert p.requires_grad == lora.is_adapter(name), name
    assert all(torch.equal(base[lora.base_name(n)], before[n]) for n in before if not lora.is_adapter(n))  # B = 0
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in trainer.model.named_parameters() if lora.is_adapter(n)}
    for _ in range(2):
        trainer.step(batch(), 9)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], full(p))}
    assert changed and all(lora.is_adapter(n) for n in changed)
    assert any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)
    merged = {name: full(p) for name, p in lora.merged_weights(trainer.model)}
    assert merged.keys() == base.keys() and any(not torch.equal(merged[n], base[n]) for n in base)


def test_kl_reference_is_the_base_with_adapters_off(qwen2_dir):
    from rollpacker.model import load_model
    from rollpacker.model.lora import AdaptersOff

    trainer = lora_trainer(qwen2_dir, kl_coef=0.1)
    assert isinstance(trainer.reference, AdaptersOff)
    for _ in range(2):
        stats = trainer.step(batch(), 9)
    assert stats["train/kl"] > 0  # the policy moved away from its base
    base = logits(load_model(qwen2_dir), PROMPT)
    assert torch.allclose(logits(trainer.reference, PROMPT), base, atol=1e-6)
    assert not torch.allclose(logits(trainer.model, PROMPT), base, atol=1e-3)


def test_engine_after_a_push_generates_what_the_merged_model_generates(qwen2_dir, tmp_path):
    """Greedy tokens of TorchEngine after an in-process push equal transformers' on the merged export."""
    import transformers

    from rollpacker.model import load_model, lora, save_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Request, SamplingParams, generate
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.rollout.weights import InProcess

    trainer = lora_trainer(qwen2_dir)
    for _ in range(2):
        trainer.step(batch(), 9)
    engine = TorchEngine(load_model(qwen2_dir), EngineConfig(block_size=4))
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    untrained = generate(engine, [Request(id="a", prompt_ids=PROMPT, params=params)])["a"].token_ids
    InProcess().push(engine, trainer.model)
    pushed = generate(engine, [Request(id="a", prompt_ids=PROMPT, params=params)])["a"].token_ids
    save_model(trainer.model, tmp_path, weights=lora.merged_weights(trainer.model))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    assert pushed == out[0, len(PROMPT):].tolist()
    assert pushed != untrained  # the adapters changed what greedy decoding picks


def test_lora_config_names_bad_settings():
    from rollpacker.model.config import LoraConfig

    with pytest.raises(ValueError, match="train.lora"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="lm_head"):
        LoraConfig(rank=8, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match=r"all-linear is every linear already; give it alone"):  # o_proj alone ran
        LoraConfig(rank=8, target_modules=("all-linear", "o_proj"))


def test_a_target_module_the_model_lacks_is_the_users_error(toy_random_dir):
    """It was a ValueError each rank printed as a traceback, in PEFT's words alone."""
    from rollpacker.errors import UserError
    from rollpacker.model import load_model, lora
    from rollpacker.model.config import LoraConfig

    with pytest.raises(UserError, match="train.lora.target_modules names foo, none of them a linear layer of the "
                                        "model: name some of down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, "
                                        "v_proj, or all-linear"):
        lora.apply(load_model(toy_random_dir), LoraConfig(rank=4, target_modules=("foo",)))
    lora.apply(load_model(toy_random_dir), LoraConfig(rank=4, target_modules=("self_attn.q_proj", "gate_up_proj")))


def test_lora_on_a_moe_refuses_the_fused_experts_and_merges_the_attention_adapters(tmp_path):
    """Naming the experts' projections (the default targets) makes PEFT adapt Qwen3-MoE's fused expert
    tensors, which merged_weights cannot merge: refused. Attention adapters merge into weights that give
    the adapted model's logits (it was an AttributeError traceback from PEFT either way)."""
    from support.models import make_hf_model

    from rollpacker.errors import UserError
    from rollpacker.model import lora
    from rollpacker.model.config import LoraConfig
    from rollpacker.model.hf_decoder import load_hf

    path = make_hf_model(tmp_path, "qwen3_moe")
    with pytest.raises(UserError, match=r"adapts the fused experts of 2 MoE layers \(model.layers.0.mlp.experts, "
                                        r"...\), .* e.g. train.lora.target_modules q_proj k_proj v_proj o_proj"):
        lora.apply(load_hf(path), LoraConfig(rank=4))
    model = lora.apply(load_hf(path), LoraConfig(rank=4, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)  # B starts at zero: make the adapters matter
    merged = load_hf(path)
    merged.load_state_dict(dict(lora.merged_weights(model)))
    torch.testing.assert_close(logits(merged, PROMPT * 3), logits(model, PROMPT * 3))
    assert not torch.allclose(logits(load_hf(path), PROMPT * 3), logits(model, PROMPT * 3), atol=1e-3)
