"""The GPU check's logic that needs no GPU: stages killed whole on their limit keeping what they printed, the
preflight's verdicts, the near-tie rule of stage (e), the summary's facts without git. The stages themselves run
in tests/dist/test_gpu_check.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollpacker.gpu_check import STAGES
from rollpacker.gpu_check.__main__ import parse, run_in_group, stage_env, stage_row, versions
from rollpacker.gpu_check.preflight import Preflight, cache_env, loaded_libcuda_dir, preflight, triton_facts
from rollpacker.gpu_check.stages import (
    SIZES,
    compare_push,
    memory,
    near_tie,
    preempted_against_first,
    pushed_exactly,
)


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped by init counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_timed_out_stage_is_killed_with_its_children_and_keeps_what_it_printed(tmp_path):
    log = tmp_path / "kernel.log"
    script = (f"sleep 300 & echo $! > {tmp_path}/child; echo 'GPU_CHECK_RESULT {{\"kernel_T8192\": 1.5}}'; "
              "sleep 300")
    start = time.perf_counter()
    rc = run_in_group(["bash", "-c", script], 2, log, dict(os.environ))
    assert rc is None and time.perf_counter() - start < 30
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(child), "the stage's child outlived its stage"
    row = stage_row("kernel", log.read_text(), rc, 2.0, 2, log)
    assert row["ok"] is False and row["kernel_T8192"] == 1.5 and row["error"].startswith("timed out after 2 s")


def test_a_finished_stage_leaves_no_process_behind(tmp_path):
    log = tmp_path / "toy.log"
    script = f"sleep 300 & echo $! > {tmp_path}/child; echo 'GPU_CHECK_RESULT {{\"ok\": true}}'"
    assert run_in_group(["bash", "-c", script], 60, log, dict(os.environ)) == 0
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(child)
    assert stage_row("toy", log.read_text(), 0, 1.0, 60, log) == {
        "stage": "toy", "letter": "a", "seconds": 1.0, "limit_s": 60, "ok": True}


def test_a_stage_that_dies_keeps_its_measurements_and_fails(tmp_path):
    text = 'GPU_CHECK_RESULT {"push": {"push_s": 0.2}}\nTraceback ...\nRuntimeError: CUDA error\n'
    row = stage_row("train", text, -9, 3.0, 80, tmp_path / "train.log")
    assert row["ok"] is False and row["push"] == {"push_s": 0.2} and "exited -9 before its result" in row["error"]
    # an ok result, then a crash in the teardown: rc decides too, and the row says why
    crashed = stage_row("train", 'GPU_CHECK_RESULT {"ok": true}', -11, 3.0, 80, tmp_path / "train.log")
    assert crashed["ok"] is False and crashed["error"] == "exited -11 after its result (log: train.log)"


def test_a_failed_stage_keeps_its_own_error_and_the_driver_holds_no_cuda_context(tmp_path):
    """A stage that fails exits 1 on purpose: its row read "exited 1 after its result" (or "hung at exit"), a
    teardown crash after a pass, and the cause it printed was only in its log. The summary's GPU name is the
    preflight probe's: read in the driver, it initialized CUDA there, a context held through every stage."""
    failed = 'GPU_CHECK_RESULT {"measured": 1, "error": "RuntimeError(\'logits differ\')", "ok": false}'
    for rc in (1, None):
        row = stage_row("judge", failed, rc, 3.0, 80, tmp_path / "judge.log")
        assert row["ok"] is False and row["measured"] == 1 and row["error"] == "RuntimeError('logits differ')"
        assert ("exit" in row) == (rc is None)
    assert versions("cuda", "NVIDIA H200")["gpu"] == "NVIDIA H200" and not torch.cuda.is_initialized()


def test_stages_run_in_order_each_once():
    assert parse(["--stages", "judge", "toy", "judge"]).stages == ["toy", "judge"]


def test_a_stage_that_hangs_after_its_result_keeps_it_and_says_so(tmp_path):
    row = stage_row("offload", 'GPU_CHECK_RESULT {"backend": "nccl", "ok": true}', None, 30.0, 30, tmp_path / "o.log")
    assert row["ok"] is True and row["backend"] == "nccl" and row["error"].startswith("hung at exit after its result")


def test_near_tie_accepts_two_tokens_at_the_top_within_eps_only():
    lp = torch.log_softmax(torch.tensor([2.0, 2.0 - 5e-5, 1.0, 2.0 - 1e-3]), -1)
    assert near_tie(lp, 0, 1, 1e-4) and near_tie(lp, 1, 0, 1e-4)
    assert not near_tie(lp, 0, 3, 1e-4)  # 1e-3 apart: a real difference
    assert not near_tie(lp, 0, 2, 1e-4)


def test_preemption_tolerates_a_genuine_near_tie_and_nothing_else(qwen2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    prompt = [5, 9, 13, 21, 34]

    def last_logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)

    best = int(last_logprobs(prompt).argmax())
    worst = int(last_logprobs(prompt).argmin())
    second = int(last_logprobs(prompt + [best]).argmax())

    def out(tokens, logprobs=None):
        return SimpleNamespace(prompt_ids=prompt, token_ids=tokens, logprobs=logprobs or [-1.0] * len(tokens))

    first = {"r": out([best, second])}
    same = preempted_against_first(hf, first, {"r": out([best, second])}, 1e-4, "cpu")
    assert same == {"preempted_near_ties": 0, "preempted_tokens_differ": 0, "preempted_max_dlogprob": 0.0}
    other = preempted_against_first(hf, first, {"r": out([worst, second])}, 1e-4, "cpu")
    assert other["preempted_tokens_differ"] == 1 and other["preempted_near_ties"] == 0
    shorter = preempted_against_first(hf, first, {"r": out([best])}, 1e-4, "cpu")
    assert shorter["preempted_tokens_differ"] == 1
    moved = preempted_against_first(hf, first, {"r": out([best, second], [-1.0, -1.5])}, 1e-4, "cpu")
    assert moved["preempted_tokens_differ"] == 0 and moved["preempted_max_dlogprob"] == 0.5
    tie = next(t for t in range(hf.config.vocab_size) if t not in (best, *prompt))
    with torch.no_grad():  # token `tie` now scores exactly as `best` after the prompt: a genuine tie
        hf.lm_head.weight[tie] = hf.lm_head.weight[best]
    assert int(last_logprobs(prompt).argmax()) in (best, tie)
    tied = preempted_against_first(hf, first, {"r": out([tie, second])}, 1e-4, "cpu")
    assert tied["preempted_near_ties"] == 1 and tied["preempted_tokens_differ"] == 0


@pytest.mark.parametrize("push, within", [("right", True), ("gate and up swapped", False), ("through fp8", False)])
def test_the_push_check_catches_a_wrong_mapping_or_dtype_in_a_bf16_engine(push, within):
    """Stage (b)'s check at toy size on CPU, with the bf16 engine a GPU uses: the last layer's gate and up
    projections swapped, or weights through fp8, fail it; the right push passes."""
    from rollpacker.model import ModelArgs, Transformer, empty_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine

    cfg = SIZES["cpu"]["train_model"]
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_hf(cfg))
    model.init_weights()
    weights = dict(model.named_parameters())
    last = f"layers.{model.args.num_layers - 1}.mlp"
    if push == "gate and up swapped":
        weights[f"{last}.gate_proj.weight"], weights[f"{last}.up_proj.weight"] = (
            weights[f"{last}.up_proj.weight"], weights[f"{last}.gate_proj.weight"])
    elif push == "through fp8":
        weights = {k: v.to(torch.float8_e4m3fn).float() for k, v in weights.items()}
    engine = TorchEngine(empty_model(model.args, "cpu", torch.bfloat16), EngineConfig(kv_memory_mb=8, max_num_seqs=4))
    engine.update_weights(weights.items())
    result = compare_push(engine, model.named_parameters, cfg, "cpu")
    assert result["within_bar"] is within and result["engine_dtype"] == "torch.bfloat16", result
    assert pushed_exactly(engine, model.named_parameters()) is within


def test_the_push_check_catches_a_stale_push_the_logprobs_cannot_see():
    """A push of the weights before a step at lr 1e-5 (less than bf16's rounding) passed the log-probs' bar."""
    from rollpacker.model import ModelArgs, Transformer, empty_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_hf(SIZES["cpu"]["train_model"]))
    model.init_weights()
    stale = {k: v.detach().clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-5 * torch.randn_like(p).sign())  # what an Adam step at lr 1e-5 moves
    engine = TorchEngine(empty_model(model.args, "cpu", torch.bfloat16), EngineConfig(kv_memory_mb=8, max_num_seqs=4))
    engine.update_weights(stale.items())
    assert not pushed_exactly(engine, model.named_parameters())
    engine.update_weights(model.named_parameters())
    assert pushed_exactly(engine, model.named_parameters())


def test_preflight_on_cuda_without_a_gpu_says_so_and_skips_every_stage(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    check = preflight("cuda", tmp_path, tmp_path, stage_env("cuda"))
    row = check.row()
    assert not row["ok"] and row["missing"][0].startswith("a CUDA device") and set(check.skip) == set(STAGES)
    assert row["says"].startswith("missing: a CUDA device") and "Runs nothing" in row["says"]


def test_a_gpu_probe_that_dies_says_why(tmp_path):
    """Its stderr and exit code were dropped: the line said IndexError('list index out of range')."""
    from rollpacker.gpu_check.preflight import probe_gpu

    (tmp_path / "torch.py").write_text("raise RuntimeError('this torch is broken')\n")
    root = Path(__file__).resolve().parents[2]
    said = probe_gpu({**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}"})["missing"]
    assert "exited 1" in said and "RuntimeError: this torch is broken" in said, said


def test_preflight_without_a_compiler_on_cuda_names_it_and_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    facts = {}
    lacks, _ = triton_facts("cuda", facts)
    assert facts["c_compiler"] is None and any("C compiler" in m and "apt-get install gcc" in m for m in lacks)
    assert triton_facts("cpu", {}) == ([], {})  # the interpreter compiles nothing
    monkeypatch.setenv("CC", "/nonexistent/gcc -O2")  # Triton takes CC as given: it said "nothing missing"
    lacks, _ = triton_facts("cuda", facts)
    assert facts["c_compiler"] is None and "the C compiler CC=/nonexistent/gcc -O2 names (fix or unset CC)" in lacks


def test_the_loaded_libcuda_is_found_by_the_file_its_link_points_to():
    """/proc/self/maps names libcuda.so.<driver>, never the libcuda.so.1 link: TRITON_LIBCUDA_PATH never came."""
    maps = ("7f1c2a000000-7f1c2a200000 r--p 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
            "7f1c2b000000-7f1c2b100000 r--p 00000000 08:01 99 /usr/lib/x86_64-linux-gnu/libz.so.1.2.13\n")
    assert loaded_libcuda_dir(maps) == "/usr/lib/x86_64-linux-gnu"
    assert loaded_libcuda_dir(maps.splitlines()[1]) is None


def test_the_preflight_line_says_what_is_missing_and_what_still_runs():
    check = Preflight({"device": "cuda"}, missing=["a C compiler (apt-get install gcc)"],
                      skip={"kernel": "Triton cannot run here"}, logprobs_impl="torch")
    assert check.row()["says"] == ("missing: a C compiler (apt-get install gcc). Runs toy, train, offload, engine, "
                                   "spec, judge (trainer stages with the torch head); skips kernel")


def test_an_unwritable_home_moves_the_caches_into_the_work_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/dev/null")  # not a folder: nothing can be made in it, even as root
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME"):
        monkeypatch.delenv(name, raising=False)
    facts = {}
    env = cache_env(tmp_path, facts)
    assert facts["home_writable"] is False
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton-cache") and env["XDG_CACHE_HOME"].startswith(str(tmp_path))


def test_the_summary_facts_survive_a_missing_git(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git
    facts = versions("cpu")
    assert facts["torch"] == torch.__version__ and facts["device"] == "cpu"
    assert facts["commit"] is None or facts["commit"].endswith("(.whl/COMMIT)")


def test_memory_on_cpu_reports_the_same_fields_empty():
    assert memory("cpu") == {"peak_allocated_gb": None, "peak_reserved_gb": None, "free_gb": None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the allocator's and driver's numbers")
def test_memory_on_cuda_reports_allocated_reserved_and_free(tmp_path):
    x = torch.empty(1 << 28, device="cuda")  # 1 GB
    mem = memory("cuda")
    assert 1.0 <= mem["peak_allocated_gb"] <= mem["peak_reserved_gb"] and mem["free_gb"] > 0
    del x
    check = preflight("cuda", tmp_path, tmp_path, stage_env("cuda"))
    assert check.facts["gpu"] and "Runs toy" in check.row()["says"], check.row()


def test_stage_env_puts_this_checkout_first_and_the_preflight_last():
    env = stage_env("cpu", {"TRITON_CACHE_DIR": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(__file__).resolve().parents[2])
    assert env["TRITON_INTERPRET"] == "1" and env["TRITON_CACHE_DIR"] == "/x" and env["ROLLPACKER_DEVICE"] == "cpu"
    assert "TRITON_INTERPRET" not in stage_env("cuda") and sys.executable
