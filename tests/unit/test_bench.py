"""``python -m rollpacker.bench engine`` end to end at tiny sizes: it runs, both engines produce the
same greedy tokens, and the last line is the JSON summary. No timing is asserted."""

from __future__ import annotations

import json
import re

import pytest

from rollpacker.bench.__main__ import main


def test_engine_bench_smoke(qwen2_dir, tmp_path, capsys):
    out = tmp_path / "curve.json"
    main([
        "engine", "--model", str(qwen2_dir), "--batch-sizes", "1", "2", "--max-new-tokens", "4",
        "--warmup-tokens", "2", "--repeats", "1", "--decode-batch-sizes", "1", "2", "--decode-steps", "2",
        "--matmul-size", "64", "--matmul-reps", "1", "--out", str(out),
    ])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    for b in (1, 2):
        for key in ("ratio_vs_hf_batch", "tok_s_torchengine_batch", "tok_s_hf_batch", "flop_fraction_batch"):
            assert summary[f"{key}{b}"] > 0, key
        assert summary[f"ratio_vs_hf_batch{b}"] == pytest.approx(
            summary[f"tok_s_torchengine_batch{b}"] / summary[f"tok_s_hf_batch{b}"], rel=0.02)
    assert set(summary["decode_ms_per_iter"]) == {"1", "2"}
    assert summary["peak_gflops"] > 0
    assert json.loads(out.read_text())["decode_ms_per_iter"] == summary["decode_ms_per_iter"]
    assert summary["same_tokens_hf_batch1"] == summary["same_tokens_hf_batch2"] == 1.0, "TorchEngine and HF disagree"


def test_hfs_prefill_is_timed_in_the_call_it_is_taken_from_and_a_ratio_over_nothing_is_null(qwen2_dir):
    """HF's prefill came from a call of its own: the fastest total could be shorter, and its decode tok/s, floored,
    read 6e9. A tail speedup over a tail of 0 s read 0.0 (a floor again): it is NaN, null in the JSON line."""
    from rollpacker.bench import json_line, ratio
    from rollpacker.bench.engine import load_hf, run_hf

    for n in (1, 4):
        run = run_hf(load_hf(qwen2_dir), [[5, 6, 7]] * 2, n, pad_id=0)
        assert 0 < run.prefill_s < run.total_s and len(run.tokens[0]) == n
    assert json_line({"tail_speedup_spec": ratio(0.0, 0.0), "rollout_speedup_spec": ratio(3.0, 2.0)}) == (
        '{"tail_speedup_spec": null, "rollout_speedup_spec": 1.5}')


def test_algorithms_bench_flags_parse_and_its_summary_is_what_it_says():
    from rollpacker.bench.algorithms import ALGORITHMS, summarize
    from rollpacker.config import parse

    configs = {name: parse(flags).train for name, flags in ALGORITHMS.items()}
    assert {"grpo", "dr_grpo", "rloo", "gspo", "cispo"} <= set(configs)
    assert (configs["dr_grpo"].advantage, configs["dr_grpo"].aggregation) == ("dr_grpo", "seq-mean-token-sum-norm")
    assert (configs["gspo"].loss, configs["cispo"].loss, configs["gspo"].mini_batches) == ("gspo", "cispo", 2)
    assert (configs["lora"].lora.rank, configs["distill"].teacher.task_weight) == (16, 0.0)
    assert configs["gdpo"].advantage == "gdpo"
    # a flag after -- that one algorithm refuses stops the bench before its first run, naming the algorithm
    with pytest.raises(SystemExit, match=r"algorithm gspo \(--train.loss gspo.*refuses `-- --train.dual-clip 3`"):
        main(["algorithms", "--algorithms", "ppo,gspo", "--", "--train.dual-clip", "3"])
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    rows += [{"step": s, "reward/mean": s / 10, "train/entropy": 1.0 - s / 10} for s in range(8)]
    rows += [{"step": 8, "eval/accuracy": 0.5}]
    # quarters of 8 steps: rewards (0, 0.1) and (0.6, 0.7); entropies (1, 0.9) and (0.4, 0.3).
    assert summarize(rows, 12.0) == pytest.approx({
        "eval_before": 0.25, "eval_after": 0.5, "eval_gain": 0.25, "reward_gain": 0.6, "entropy_first": 0.95,
        "entropy": 0.35, "wall_s": 12.0})


def test_runs_a_bench_cannot_make_or_read_are_refused_before_the_first(tmp_path, capsys):
    """regime ran sync, then met the job's refusal of tail+stream with --train.skip as a traceback; algorithms and
    parity ran every job under `-- --eval-every 0`, then an IndexError; parity's tail policy alone or first had no
    kept and cut figures."""
    from rollpacker.bench import parity

    shape = ["--num-layers", "1", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
             "--intermediate-size", "128"]
    with pytest.raises(SystemExit, match=r"policy tail\+stream \(rolling out alone: --train.skip\) refuses `-- `"):
        main(["regime", "--policies", "sync,tail+stream", "--model-dir", str(tmp_path / "m"), *shape])
    for bench in ("algorithms", "parity"):
        with pytest.raises(SystemExit, match=r"compares held-out evaluations: `-- --eval-every 0` turns them off"):
            main([bench, "--", "--eval-every", "0"])
    records = [{"eval/accuracy": 0.5}, {"reward/mean": 1.0, "sched/cut_episodes": 2.0,
                                        **{f"sched/{side}/{key}": 1.0 for side in ("kept", "cut")
                                           for key in parity.SELECTION}}, {"eval/accuracy": 0.75}]
    summary = parity.report(parity.Args(policies="tail_keep_first,sync"),
                            {"tail_keep_first": [parity.summarize(records, 1.0)],
                             "sync": [parity.summarize([records[0], {"reward/mean": 1.0}, records[2]], 1.0)]})
    assert summary["cut_turns_tail_keep_first"] == 1.0 and "kept_turns_sync" not in summary
    capsys.readouterr()
    with pytest.raises(SystemExit):  # its usage named the file bench/__main__.py, which runs no logprobs
        main(["logprobs", "--help"])
    assert "usage: python -m rollpacker.bench logprobs" in capsys.readouterr().out


def test_the_faults_bench_removes_its_temporary_runs_unless_one_failed(monkeypatch, capsys):
    """It left 120 MB of checkpoints a run in a temporary directory it never named."""
    from rollpacker.bench import faults

    made = []

    def runs(args, work):
        (work / "run_00").mkdir()
        made.append(work)
        return len(made) == 1  # the first bench recovered every run, the second did not

    monkeypatch.setattr(faults, "bench", runs)
    faults.main(["--runs", "1"])
    faults.main(["--runs", "1"])
    assert not made[0].exists() and (made[1] / "run_00").is_dir()
    assert f"a run did not recover: its logs and checkpoints are kept in {made[1]}" in capsys.readouterr().err
    import shutil

    shutil.rmtree(made[1])


def test_sessions_bench_smoke(capsys):
    """``bench sessions`` at tiny sizes: resident turns give the scratch turns' tokens, prefilling fewer,
    and evict sessions under a KV budget that cannot hold them all (4 blocks of 16 tokens)."""
    main(["sessions", "--episodes", "3", "--turns", "3", "--prompt-tokens", "8", "--new-tokens", "4",
          "--obs-tokens", "4", "--repeats", "1", "--kv-memory-mb", "0.125"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tokens_changed"] == 0 and summary["logprob_max_diff"] < 1e-5
    assert 0 < summary["prefill_tokens_ratio"] < 1 and summary["session_evictions"] > 0, summary


def _sleep_a_while(ready) -> None:
    import time

    ready.set()
    time.sleep(60)


def test_faults_over_episodes_count_environments_left_open_and_workers_left_alive(tmp_path):
    """``bench faults --workload episodes``' accounting: each environment records itself made (with its worker's
    pid) and closed; one never closed, and a worker still alive after its run, are counted."""
    import multiprocessing as mp

    from rollpacker.bench.faults import Args, environments, episode_flags

    run_dir = tmp_path / "run_00"
    flags = episode_flags(run_dir)
    assert flags[:2] == ["--env.factory", f"{run_dir.with_suffix('.env.py')}:make_env"]
    assert "log=" in run_dir.with_suffix(".env.py").read_text()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    worker = ctx.Process(target=_sleep_a_while, args=(ready,), daemon=True)
    worker.start()
    try:
        assert ready.wait(60)
        log = run_dir.with_suffix(".envs")
        (log / "1-a.made").write_text(str(worker.pid))  # open, its worker alive
        (log / "2-b.made").write_text("999999999")  # closed, its worker gone
        (log / "2-b.closed").touch()
        assert environments(run_dir) == {"envs_made": 2, "envs_unclosed": 1, "workers_left": 1}
    finally:
        worker.kill()
        worker.join()
    assert environments(run_dir)["workers_left"] == 0
    with pytest.raises(ValueError, match="single or episodes"):
        Args(workload="agentic")


def test_a_faults_run_that_ended_before_its_fault_is_not_a_recovery(tmp_path, monkeypatch):
    """A job that ends before its fault's point exits 0 with the reference's ledger, but nothing was healed."""
    import random
    import subprocess
    import sys

    from rollpacker.bench import faults

    def launch(run_dir, episodes=False):
        log = run_dir.with_suffix(".log")
        log.write_text("")
        return subprocess.Popen([sys.executable, "-c", "pass"]), log

    monkeypatch.setattr(faults, "launch", launch)
    result = faults.one_run(0, "kill_rank", tmp_path, random.Random(0), 60, [])
    assert result["injected"] is False and result["exit"] == 0 and result["recovered"] is False


def test_bench_flags_that_cannot_run_are_refused_as_they_parse(tmp_path):
    """Each was a traceback (int() of a seed, an empty evaluation list, numpy's probabilities, a model loaded
    first), a run of nothing, or a model of another shape used unsaid."""
    from rollpacker.bench import algorithms, faults, rewards, schedulers, spec, spec_engine
    from rollpacker.jobflags import MemoryRegime, memory_regime_flags

    for args in (algorithms.Args, schedulers.Args, spec.Args):
        with pytest.raises(ValueError, match="--seeds '0,a': write comma-separated integers"):
            args(seeds="0,a")
    with pytest.raises(ValueError, match="--eval-every and --teacher-steps must be positive, got 50, 0 and 100"):
        algorithms.Args(eval_every=0)
    with pytest.raises(ValueError, match="--responses and --workers must be positive, got 0"):
        rewards.Args(responses=0)
    with pytest.raises(ValueError, match=r"a sum <= 1 .* got 0.9 \+ 0.2 \+ 0.2"):
        rewards.Args(loop_fraction=0.9, slow_fraction=0.2)
    with pytest.raises(ValueError, match=r"bench.spec_max_tokens must be in \[1, 32\], got 0"):
        spec_engine.SpecBenchConfig(spec_max_tokens=0)
    with pytest.raises(ValueError, match="--runs must be >= 1"):
        faults.Args(runs=-1)
    shape = dict(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
    memory_regime_flags(MemoryRegime(model_dir=tmp_path, **shape))
    assert "--model.path" in memory_regime_flags(MemoryRegime(model_dir=tmp_path, **shape))  # the same shape: kept
    with pytest.raises(SystemExit, match="holds a model of another shape: num_hidden_layers=1 \\(asked 2\\)"):
        memory_regime_flags(MemoryRegime(model_dir=tmp_path, **shape | dict(num_layers=2)))
    # a POLICY+VARIANT the job refuses, refused as the benchmark parses it (not after the runs before it)
    from rollpacker.jobflags import policy_args

    for policy, said in (("sorted+pipe", "schedule:sorted does not run with RolloutPipe; it runs on top of sync, tail"),
                         ("one_step_off+stream_kv", "schedule:one_step_off does not run with stream training")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            policy_args(policy)
    assert policy_args("tail+pipe")[:2] == ["schedule:tail", "--schedule.pipe"]
    # each met after minutes of runs (an unknown policy after the ones before it), or a traceback
    from rollpacker.bench import episodes, regime, step

    for make, flags, said in ((schedulers.Args, dict(policies="sync,tial"), "unknown policy 'tial'"),
                              (spec.Args, dict(policies="tail,synk"), "unknown policy 'synk'"),
                              (regime.Args, dict(policies="sync,sortd"), "unknown policy 'sortd'"),
                              (episodes.Args, dict(policies="sync,tail+wram"), "unknown policy 'tail+wram'"),
                              (episodes.Args, dict(policies="sync+paper"), "+paper is tail's"),
                              (schedulers.Args, dict(ablation_steps=0), "--ablation-steps and --nproc must be >= 1"),
                              (schedulers.Args, dict(nproc=0), "--ablation-steps and --nproc must be >= 1"),
                              (step.Args, dict(steps=0), "--nproc and --steps must be >= 1")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            make(**flags)
    for make, flags, said in ((rewards.Args, dict(remote_median_s=-0.5), "--remote-median-s, --fixed-timeout and "),
                              (rewards.Args, dict(fixed_timeout=0), "must be positive, got 0.5, 0"),
                              (algorithms.Args, dict(teacher=str(tmp_path / "nope")), "no config.json there")):
        with pytest.raises(ValueError, match=re.escape(said)):
            make(**flags)
    with pytest.raises(ValueError, match=r"bench.num_prompts=4096 exceeds the default job's \d+ prompts"):
        spec_engine.run(spec_engine.SpecBenchConfig(num_prompts=4096))  # was random.sample's, after calibrating
    assert policy_args("sorted_partial+stream")[:2] == ["schedule:sorted_partial", "--stream.enabled"]
