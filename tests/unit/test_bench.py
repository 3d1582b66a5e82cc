"""``python -m rollpacker.bench engine`` end to end at tiny sizes: it runs, both engines produce the
same greedy tokens, and the last line is the JSON summary. No timing is asserted."""

from __future__ import annotations

import json

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
