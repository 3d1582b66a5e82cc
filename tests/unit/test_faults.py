"""Faults (issue #22): bad inputs refused with one error naming the place, or skipped and counted."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import save_file

from rollpacker import checkpoint
from rollpacker.config import load_preset, parse
from rollpacker.data.dataset import DataConfig, DatasetError, fit_rows, load_rows
from rollpacker.errors import UserError
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.scheduler import build_functions, check_row


def write(tmp_path, lines: list[str], name: str = "train.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = json.dumps({"prompt": "1+1?", "answer": "2"})
MATH = build_functions(RewardConfig(funcs=("math", "code")))


def load(path: str, **config) -> list[dict]:
    return load_rows(DataConfig(path=path, **config), lambda row: check_row(MATH, row))


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "invalid JSON (Expecting property name enclosed in double quotes at column 2)"),
    (json.dumps({"answer": "2"}), "missing field 'prompt'"),
    (json.dumps({"prompt": "x"}), "missing field 'answer' (math) or 'tests' (code): no reward function"),
    (json.dumps({"prompt": "x", "tests": [{"output": 3}]}), "field 'tests' must be a non-empty list"),
    (json.dumps({"prompt": ["x"], "answer": "2"}), "field 'prompt': message 0 is not a"),
])
def test_a_bad_line_names_file_and_line_and_the_way_out(tmp_path, line, message):
    path = write(tmp_path, [GOOD, line])
    with pytest.raises(DatasetError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}:2: {message}")
    assert str(e.value).endswith("set data.skip_bad_lines to skip bad rows)")


def test_skip_bad_lines_keeps_the_good_ones_and_counts_the_rest(tmp_path, caplog):
    path = write(tmp_path, [GOOD, "{not json", json.dumps({"prompt": "x"}), "",
                            json.dumps({"prompt": "3", "answer": "3"})])
    with caplog.at_level(logging.WARNING, logger="rollpacker.data.dataset"):
        rows = load(path, skip_bad_lines=True)
    assert [(r["id"], r["prompt"]) for r in rows] == [("train:1", "1+1?"), ("train:5", "3")]  # ids: their lines
    assert f"{path}: skipped 2 bad row(s), kept 2 (data.skip_bad_lines); first: {path}:2: invalid JSON" in caplog.text
    assert f"{path}:3: missing field 'answer'" in caplog.text
    only_bad = write(tmp_path, ["{", "[]"], "bad.jsonl")
    with pytest.raises(DatasetError,
                       match=re.escape(f"{only_bad}: no rows (the data is empty or holds only blank or bad rows: "
                                       "line 1: invalid JSON")):
        load(only_bad, skip_bad_lines=True)


def test_an_unknown_key_in_a_preset_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("num_steps = 3\n[rollout]\nnum_prompt = 4\n")
    with pytest.raises(ValueError) as e:
        load_preset(str(bad))
    assert str(e.value).startswith(f"{bad}: unknown setting 'rollout.num_prompt' (valid: num_prompts, ")


def test_prompts_that_do_not_fit_are_left_out_and_counted(caplog):
    rows = [{"id": str(n), "n": n} for n in (0, 3, 10, 16, 30)]
    with caplog.at_level(logging.WARNING, logger="rollpacker.data.dataset"):
        kept = fit_rows(rows, lambda r: [1] * r["n"], max_model_len=16, kv_tokens=24, max_new_tokens=4)
    assert [r["n"] for r in kept] == [3, 10]
    assert ("left out 3 of 5 prompts of data.path that are empty or do not fit the context length 16 or the KV cache "
            "of 24 tokens (with rollout.max_new_tokens=4): '0' (0 tokens), '16' (16 tokens), '30' (30 tokens)"
            ) in caplog.text
    # the KV cache, not the context, limits: 10 prompt + 8 new tokens need 18 > 16 tokens of KV
    assert [r["n"] for r in fit_rows(rows, lambda r: [1] * r["n"], 64, 16, 8)] == [3]
    with pytest.raises(DatasetError, match="no prompt of data.path fits the context length 16 and the KV cache of 2 "):
        fit_rows(rows, lambda r: [1] * r["n"], 16, 2, 4)
    with pytest.raises(DatasetError, match=r"raise engine.memory_mb \(the KV .*\) or the model's context"):
        fit_rows(rows, lambda r: [1] * r["n"], 16, 2, 4, kv_setting="engine.memory_mb (the KV ...)")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollpacker.data.dataset"):  # data.max_prompt_length: verl's filter
        assert [r["n"] for r in fit_rows(rows, lambda r: [1] * r["n"], 64, 64, 4, max_prompt_length=10)] == [3, 10]
    assert "left out 3 of 5 prompts of data.path that are empty, longer than data.max_prompt_length=10" in caplog.text
    # every held-out prompt over the limit: the set and the setting to raise are named
    with pytest.raises(DatasetError, match=r"no prompt of data.eval_path fits .* and data.max_prompt_length=2: "
                                           r"shorten the prompts, or raise data.max_prompt_length, engine.kv_"):
        fit_rows(rows, lambda r: [1] * r["n"], 64, 64, 4, max_prompt_length=2, field="data.eval_path")


def committed(tmp_path, **meta):
    (tmp_path / "train_state.json").write_text(json.dumps({"step": 1, "policy": {"name": "sync"}, **meta}))
    (tmp_path / checkpoint.MARKER).write_text("")
    return tmp_path


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path):
    path = committed(tmp_path, world_size=2)
    checkpoint.check(path, "sync", world_size=2)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check(path, "sync", world_size=4)
    assert str(e.value) == (f"resume: {path} was written by 2 ranks, this run has 4: launch it with 2 ranks "
                            "(torchrun --nproc_per_node), or start afresh")


def test_a_run_directory_given_as_the_checkpoint_is_named_with_the_way_out(tmp_path):
    """TRL and verl take the run's directory; ours said a save had been interrupted."""
    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    committed(step, world_size=1)
    for given in (tmp_path, tmp_path / "checkpoints"):
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(
                f"resume: {given} is a run's directory, not a checkpoint: resume with --resume auto --run-dir "
                f"{tmp_path} (its newest whole checkpoint), or --resume {step}")):
            checkpoint.check(given, world_size=1)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(  # it said the file did not exist
            f"resume: {step / 'train_state.json'} is a file: give its checkpoint's directory ({step})")):
        checkpoint.check(step / "train_state.json", world_size=1)


def test_a_checkpoint_of_another_model_is_refused_listing_the_differences(tmp_path):
    mine = {"embed.weight": [64, 8], "layers.0.w": [8, 8], "norm.weight": [8]}
    checkpoint.check_model(tmp_path, dict(mine), mine)
    checkpoint.check_model(tmp_path, None, mine)  # written before shapes were recorded
    saved = {"embed.weight": [32, 8], "layers.0.w": [8, 8], "layers.1.w": [8, 8]}
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_model(tmp_path, saved, mine)
    assert str(e.value) == (
        f"resume: {tmp_path} was written by a different model: parameters 1 not in the checkpoint: norm.weight; "
        "1 only in the checkpoint: layers.1.w; 1 with other shapes (checkpoint vs this model): "
        "embed.weight [32, 8] vs [64, 8]. Load it with the model the run started with (model.path); a resume may "
        "instead start afresh")
    lora = {"layers.0.w.base_layer.weight": [8, 8], "layers.0.w.lora_A.default.weight": [2, 8]}
    with pytest.raises(checkpoint.CheckpointError, match=r"It holds LoRA adapters: give the run's train.lora"):
        checkpoint.check_model(tmp_path, lora, mine)  # an export without the run's train.lora flags
    with pytest.raises(checkpoint.CheckpointError, match=r"It holds no LoRA adapters: drop train.lora.rank"):
        checkpoint.check_model(tmp_path, mine, lora)
    other = {"layers.0.w.base_layer.weight": [8, 8], "layers.0.w.lora_A.default.weight": [4, 8]}
    with pytest.raises(checkpoint.CheckpointError, match=r"Its LoRA adapters sit on other modules or have another "
                                                         r"rank: give the run's train.lora.target_modules"):
        checkpoint.check_model(tmp_path, other, lora)  # the same model, adapted otherwise
    # the same model under the other model.impl: it blamed model.path, which the user had not changed
    hf = {"model.embed_tokens.weight": [64, 8], "model.norm.weight": [8], "lm_head.weight": [64, 8]}
    native = {"embed_tokens.weight": [64, 8], "norm.weight": [8], "lm_head.weight": [64, 8]}
    for saved, mine, impl in ((native, hf, "native"), (hf, native, "hf")):
        with pytest.raises(checkpoint.CheckpointError, match=rf"was written by this model under model.impl {impl}, "
                                                             rf"which names its parameters otherwise: resume with "
                                                             rf"--model.impl {impl}$"):
            checkpoint.check_model(tmp_path, saved, mine)


def test_lora_adapters_resumed_under_another_alpha_are_refused(toy_random_dir, tmp_path):
    """The adapters' update is scaled by alpha / rank: resumed under another train.lora.alpha the policy would
    change without a word. The checkpoint's export_flags hold the run's."""
    from rollpacker.dist import build_meshes
    from rollpacker.job import export_flags
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    lora = ["--train.lora.rank", "8", "--train.lora.alpha", "32"]
    trainer = Trainer(load_model(toy_random_dir), TrainConfig(), build_meshes(1, 0).train, num_steps=4)
    checkpoint.save(tmp_path, trainer, 1, {"export_flags": export_flags(parse(lora))})
    checkpoint.resolve_resume(parse([*lora, "--resume", str(tmp_path)]))
    checkpoint.resolve_resume(parse(["--resume", str(tmp_path)]))  # no adapters: check_model names what differs
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.resolve_resume(parse(["--train.lora.rank", "8", "--resume", str(tmp_path)]))
    assert str(e.value) == (f"resume: {tmp_path} trained its LoRA adapters with train.lora.alpha 32, this run sets "
                            "16: an adapter's update is scaled by alpha / rank, so the policy would change at resume. "
                            "Resume (or export) with train.lora.alpha 32")


def test_a_torchrun_restart_resumes_from_the_newest_checkpoint_not_the_first_attempts(toy_random_dir, tmp_path,
                                                                                      monkeypatch):
    """A job started with --resume PATH went back to PATH at each torchrun restart, un-committing every step since;
    a fresh start's restart was refused as overwriting its own run."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(), build_meshes(1, 0).train, num_steps=4)
    for step in (1, 2):
        checkpoint.save(tmp_path / "checkpoints" / f"step_{step}", trainer, step, {})
    first = parse(["--run-dir", str(tmp_path), "--resume", str(tmp_path / "checkpoints" / "step_1")])
    checkpoint.resolve_resume(first)
    assert first.resume == str(tmp_path / "checkpoints" / "step_1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for argv in (["--resume", str(tmp_path / "checkpoints" / "step_1")], []):
        config = parse(["--run-dir", str(tmp_path), *argv])
        checkpoint.resolve_resume(config)
        assert config.resume == str(tmp_path / "checkpoints" / "step_2")
    # a PATH that is no checkpoint (a typo) is said again at the restart, not trained past from the newest
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint directory .*step_9 does not exist"):
        checkpoint.resolve_resume(parse(["--run-dir", str(tmp_path), "--resume", str(tmp_path / "step_9")]))
    # a run_dir the attempts before saved nothing in: the checkpoint named (another run's), as the first attempt
    elsewhere = parse(["--run-dir", str(tmp_path / "new"), "--resume", str(tmp_path / "checkpoints" / "step_1")])
    checkpoint.resolve_resume(elsewhere)
    assert elsewhere.resume == str(tmp_path / "checkpoints" / "step_1")


def test_a_restart_resumes_only_what_its_own_attempts_saved(toy_random_dir, tmp_path, monkeypatch):
    """A fresh start refused over an earlier job's run became, at torchrun's restart, a resume of that run (exit 0,
    its weights trained on under the new flags); a job started from a named checkpoint of it jumped to its newest."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(), build_meshes(1, 0).train, num_steps=4)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "earlier")
    for step in (1, 2):
        checkpoint.save(tmp_path / "checkpoints" / f"step_{step}", trainer, step, {})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "this")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(UserError, match="holds a run .*step_2.*which a fresh start would overwrite"):
        checkpoint.resolve_resume(parse(["--run-dir", str(tmp_path)]))
    named = parse(["--run-dir", str(tmp_path), "--resume", str(tmp_path / "checkpoints" / "step_1")])
    checkpoint.resolve_resume(named)
    assert named.resume == str(tmp_path / "checkpoints" / "step_1")
    checkpoint.save(tmp_path / "checkpoints" / "step_3", trainer, 3, {})  # this job's first attempt went on from it
    for argv in (["--resume", str(tmp_path / "checkpoints" / "step_1")], []):
        config = parse(["--run-dir", str(tmp_path), *argv])
        checkpoint.resolve_resume(config)
        assert config.resume == str(tmp_path / "checkpoints" / "step_3")


def test_adapters_trained_on_another_base_of_the_same_shapes_are_refused(tmp_path):
    """A LoRA checkpoint holds no base: resumed on another model of the same shapes (the instruct one for the
    base one), the adapters would go on training on it without a word."""
    def base(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        model[0].requires_grad_(False)  # the frozen base; model[1] stands for the adapters
        return model

    saved = checkpoint.frozen_norms(base(0))
    assert list(saved) == ["0.weight", "0.bias"]
    checkpoint.check_base(tmp_path, saved, checkpoint.frozen_norms(base(0)))
    checkpoint.check_base(tmp_path, None, saved)  # written before the norms were recorded
    checkpoint.check_base(tmp_path, {}, saved)  # nothing frozen: a full fine-tune saves every parameter
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_base(tmp_path, saved, checkpoint.frozen_norms(base(1)))
    assert str(e.value) == (
        f"resume: {tmp_path} was trained on another base model: 2 of the 2 frozen parameters it does not save "
        "differ from model.path's (0.bias, 0.weight). Resume with the model.path the run started with, or start afresh")


def test_keep_deletes_the_oldest_committed_checkpoints_and_stale_interrupted_ones(tmp_path):
    for step, done in ((1, True), (2, False), (3, True), (4, True), (5, False)):
        (tmp_path / f"step_{step}").mkdir()
        if done:
            (tmp_path / f"step_{step}" / checkpoint.MARKER).write_text("")
    assert [p.name for p in checkpoint.prune(tmp_path, keep=2)] == ["step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4", "step_5"]  # step_5: a save under way
    with pytest.raises(ValueError, match="checkpoint.keep must be >= 0 \\(0 keeps every checkpoint\\), got -1"):
        checkpoint.CheckpointConfig(keep=-1)


def test_what_a_save_also_writes_is_in_the_commit_and_its_failure_fails_the_save(toy_random_dir, tmp_path):
    """``also`` (the Hugging Face export of checkpoint.export_hf_each) writes into the checkpoint before its commit
    marker: a committed checkpoint has it, and a failed write removes the save like a failed shard."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(), build_meshes(1, 0).train, num_steps=4)
    first = tmp_path / "checkpoints" / "step_1"

    def export() -> None:
        assert not (first / checkpoint.MARKER).exists()  # before the commit
        (first / "hf").mkdir()
        (first / "hf" / "config.json").write_text("{}")

    checkpoint.save(first, trainer, 1, {}, also=export)
    assert checkpoint.latest(tmp_path) == first and (first / "hf" / "config.json").is_file()

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(checkpoint.CheckpointError, match=r"saving step 2 .* failed on rank\(s\) \[0\] \(rank 0: "
                                                         r"OSError: \[Errno 28\] No space left on device"):
        checkpoint.save(tmp_path / "checkpoints" / "step_2", trainer, 2, {}, also=full_disk)
    assert checkpoint.latest(tmp_path) == first and not (tmp_path / "checkpoints" / "step_2").exists()

    def under_a_file() -> None:  # a real failed write of safetensors, whose error is no OSError
        save_file({"w": torch.zeros(2)}, tmp_path / "a_file" / "model.safetensors")

    (tmp_path / "a_file").write_text("")
    with pytest.raises(checkpoint.CheckpointError, match=r"saving step 2 .* \(rank 0: SafetensorError: Error while "
                                                         r"serializing: I/O error: Not a directory"):
        checkpoint.save(tmp_path / "checkpoints" / "step_2", trainer, 2, {}, also=under_a_file)
    assert checkpoint.latest(tmp_path) == first and not (tmp_path / "checkpoints" / "step_2").exists()


def test_a_first_save_whose_directory_cannot_be_made_says_so(toy_random_dir, tmp_path):
    """A run's first save, into a checkpoints/ that cannot be made (a scratch mount not there): the free space
    was read in that directory, and its FileNotFoundError came out as a traceback in place of the message."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(), build_meshes(1, 0).train, num_steps=4)
    (tmp_path / "checkpoints").symlink_to(tmp_path / "unmounted" / "checkpoints")
    with pytest.raises(checkpoint.CheckpointError, match=rf"saving step 1 .* failed on rank\(s\) \[0\] .* MiB free in "
                                                         rf"{tmp_path} on rank 0\)"):
        checkpoint.save(tmp_path / "checkpoints" / "step_1", trainer, 1, {})


def test_a_run_that_went_back_uncommits_the_later_checkpoints_it_left_and_keep_spares_its_own(toy_random_dir,
                                                                                             tmp_path):
    """Resumed from step 2 (step 4 damaged, or a deliberate rollback), the run un-commits step 4 as it starts
    (the abandoned run's, whose records it drops), then saves step 3: --resume auto takes step 3 and
    checkpoint.keep=1 keeps it."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(), build_meshes(1, 0).train, num_steps=4)
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        checkpoint.save(root / f"step_{step}", trainer, step, {})
    checkpoint.leave_later(tmp_path, 2)
    assert checkpoint.committed(tmp_path) == [root / "step_2"]
    checkpoint.save(root / "step_3", trainer, 3, {}, keep=1)
    assert checkpoint.committed(tmp_path) == [root / "step_3"] and checkpoint.newest_whole(tmp_path) == root / "step_3"
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]  # step 4's files go when step 4 is saved
    checkpoint.save(root / "step_4", trainer, 4, {}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_4"] and checkpoint.latest(tmp_path) == root / "step_4"


def test_a_resume_goes_on_with_the_adaptive_kl_coefficient_and_takes_a_fixed_one_from_its_flag(toy_random_dir,
                                                                                               tmp_path):
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    def trainer(**kl) -> Trainer:
        return Trainer(load_model(toy_random_dir), TrainConfig(**kl), build_meshes(1, 0).train, num_steps=4)

    saved = trainer(kl_coef=0.1, kl_target=0.01)
    saved.kl.value = 0.125  # where the controller had moved it
    checkpoint.save(tmp_path / "step_1", saved, 1, {})
    adaptive, fixed = trainer(kl_coef=0.1, kl_target=0.01), trainer(kl_coef=0.05)
    for t in (adaptive, fixed):
        checkpoint.load(tmp_path / "step_1", t)
    assert (adaptive.kl.value, fixed.kl.value) == (0.125, 0.05)


def test_a_resume_takes_the_lr_and_adam_settings_of_its_flags_and_keeps_the_schedules_step(toy_random_dir, tmp_path,
                                                                                          caplog):
    """The NaN stop's advice, "lower train.lr, raise train.adam_eps ... then resume": the checkpoint's lr and eps
    were restored over the flags, so the resumed run went on as before."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer, lr_factor

    def trainer(**train) -> Trainer:
        return Trainer(load_model(toy_random_dir), TrainConfig(warmup_steps=4, **train), build_meshes(1, 0).train,
                       num_steps=8)

    saved = trainer(lr=2e-4)
    for _ in range(2):
        saved.optimizer.step()
        saved.scheduler.step()
    checkpoint.save(tmp_path / "step_2", saved, 2, {})
    resumed = trainer(lr=1e-5, adam_eps=1e-3)
    with caplog.at_level(logging.INFO, logger="rollpacker.checkpoint"):
        checkpoint.load(tmp_path / "step_2", resumed)
    group = resumed.optimizer.param_groups[0]
    assert resumed.scheduler.last_epoch == 2 and group["eps"] == 1e-3
    assert group["lr"] == pytest.approx(1e-5 * lr_factor(2, resumed.config, 8))
    resumed.scheduler.step()
    assert group["lr"] == pytest.approx(1e-5 * lr_factor(3, resumed.config, 8))
    assert "resume: train.lr: 0.0002 -> 1e-05, train.adam_eps: 1e-08 -> 0.001" in caplog.text
    same = trainer(lr=2e-4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rollpacker.checkpoint"):
        checkpoint.load(tmp_path / "step_2", same)
    assert same.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"] and not caplog.text


def test_nonfinite_steps_are_counted_never_saved_and_stop_the_run_when_in_a_row(toy_random_dir, tmp_path):
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import NonFiniteError, Sample, Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(lr=1e-2, max_skipped_steps=2), build_meshes(1, 0).train,
                      num_steps=4)
    bad, good = [Sample([5, 6, 7], [8, 9], float("nan"), [-1.0, -1.0])], [Sample([5, 6, 7], [8, 9], 1.0, [-1.0, -1.0])]
    assert trainer.step(bad, 2)["train/skipped_steps"] == 1.0
    checkpoint.save(tmp_path / "checkpoints" / "step_1", trainer, 1, {})
    assert checkpoint.latest(tmp_path) is None  # the weights that just produced a non-finite update
    assert trainer.step(good, 2)["train/skipped_steps"] == 1.0
    checkpoint.save(tmp_path / "checkpoints" / "step_2", trainer, 2, {})
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "step_2"
    assert trainer.step(bad, 2)["train/skipped_steps"] == 2.0  # one in a row: the run goes on
    with pytest.raises(NonFiniteError) as e:
        trainer.step(bad, 2)
    assert str(e.value) == (
        "train: 2 consecutive steps skipped for a non-finite loss or gradient (last: loss=nan, grad_norm=nan; "
        "train.max_skipped_steps=2). Stopping without saving these weights: the newest committed checkpoint "
        "predates them. Lower train.lr, raise train.adam_eps, check the rewards and data, then resume from that "
        "checkpoint")
    with pytest.raises(ValueError, match="train.max_skipped_steps must be"):
        TrainConfig(max_skipped_steps=-1)
    # several updates a step (epochs) are one step: one bad step is one skipped, not three
    many = Trainer(load_model(toy_random_dir), TrainConfig(lr=1e-2, epochs=3, max_skipped_steps=3),
                   build_meshes(1, 0).train, num_steps=4)
    stats = many.step(bad, 2)
    assert (stats["train/skipped"], stats["train/skipped_steps"], many.skipping) == (3.0, 1.0, 1)


def test_resume_auto_passes_over_a_damaged_checkpoint_with_one_warning_naming_the_file(toy_random_dir, tmp_path,
                                                                                        capsys):
    """A truncated shard, .metadata or train state, or a missing shard: --resume auto takes the
    checkpoint before it (issue #36); with none left whole, one error names them."""
    import shutil

    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(), build_meshes(1, 0).train, num_steps=4)
    saved = tmp_path / "saved"
    for step in (1, 2):
        checkpoint.save(saved / "checkpoints" / f"step_{step}", trainer, step, {"policy": {"name": "sync"}})
    assert checkpoint.newest_whole(saved) == saved / "checkpoints" / "step_2"
    shard = next(p.name for p in (saved / "checkpoints" / "step_2").glob("*.distcp"))
    for i, (name, damage, why) in enumerate([
            (shard, lambda f: f.write_bytes(f.read_bytes()[:1000]), r"is truncated \(1000 bytes; its index in "
                                                                     r"\.metadata needs \d+\)"),
            (".metadata", lambda f: f.write_bytes(f.read_bytes()[:100]), r"cannot be read \(.+\)"),
            ("train_state.json", lambda f: f.write_text(f.read_text()[:40]), r"cannot be read \(JSONDecodeError: .+\)"),
            (shard, lambda f: f.unlink(), r"cannot be read \(FileNotFoundError: .+\)")]):
        run = tmp_path / f"run_{i}"
        shutil.copytree(saved, run)
        newest = run / "checkpoints" / "step_2"
        damage(newest / name)
        assert checkpoint.newest_whole(run) == run / "checkpoints" / "step_1"
        said = capsys.readouterr().err
        assert re.fullmatch(rf"rollpacker: warning: checkpoint {newest} is damaged: {newest / name} {why}; resuming "
                            r"from the one before it\n", said), said
    (run / "checkpoints" / "step_1" / "train_state.json").write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match=rf"^resume: every committed checkpoint under "
                       rf"{run / 'checkpoints'} is damaged \(.+\): move them away to start afresh$"):
        checkpoint.newest_whole(run, announce=False)
    with pytest.raises(checkpoint.CheckpointError, match=rf"^resume: {run / 'checkpoints' / 'step_1'}/train_state.json "
                       r"cannot be read \(JSONDecodeError: .+\); resume from an earlier checkpoint"):
        checkpoint.check(run / "checkpoints" / "step_1")
    garbled = saved / "checkpoints" / "step_2" / shard  # whole in size, unreadable in content
    garbled.write_bytes(b"\0" * garbled.stat().st_size)
    with pytest.raises(checkpoint.CheckpointError, match=rf"^resume: {garbled.parent} cannot be read \(.+\): move it "
                       "away and resume with --resume auto, which takes the checkpoint before it$"):
        checkpoint.load(garbled.parent, trainer)


def test_an_export_out_holding_the_runs_model_is_refused(tmp_path):
    """A model directory holds a config.json, which read as an earlier export's: an --out naming model.path (or a
    LoRA run's out_merged beside it) replaced the base model's weights with the export."""
    from rollpacker.export import check_out

    model = tmp_path / "models" / "base_merged"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    step = tmp_path / "run" / "checkpoints" / "step_1"
    for out, lora in ((model, False), (tmp_path / "models", False), (model / "..", False),
                      (tmp_path / "models" / "base", True)):
        with pytest.raises(UserError, match=rf"the export replaces {re.escape(str(tmp_path / 'models'))}\S* whole, "
                                            rf"and it holds model.path {re.escape(str(model))}; name a directory"):
            check_out(out, step, lora, model=str(model))
    check_out(tmp_path / "models" / "base", step, False, model=str(model))


def test_a_failed_export_leaves_no_half_written_directory(tmp_path):
    """A disk that filled up mid-export kept the half-written weights beside --out, taking the space it lacked."""
    from rollpacker.job import Job

    out = tmp_path / "hf"
    with pytest.raises(OSError, match="No space left"):
        with Job._fresh(out, writer=True) as fresh:
            (fresh / "model.safetensors").write_bytes(b"\0" * 1024)
            raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []
