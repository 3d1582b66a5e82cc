"""``bench episodes``' environment alone: its latency specs and its heavy-tailed, deterministic turns."""

from __future__ import annotations

import statistics

import pytest

from rollpacker.bench.episodes import Args, HeavyTailEnv, latency_sampler
from rollpacker.toy.task import make_dataset


def test_lognormal_latency_has_its_mean_and_is_deterministic():
    draw = latency_sampler("lognormal:0.3:1.0")
    xs = [draw(f"k{i}") for i in range(20000)]
    assert statistics.mean(xs) == pytest.approx(0.3, rel=0.05) and max(xs) > 3 * 0.3  # a heavy right tail
    assert [draw("a"), draw("b")] == [draw("a"), draw("b")]
    assert latency_sampler("lognormal:0:1")("x") == 0.0


def test_a_trace_is_replayed_and_bad_specs_say_the_fix(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("0.1\n0.5\n2.0\n")
    draw = latency_sampler(f"trace:{trace}")
    assert {draw(f"k{i}") for i in range(100)} == {0.1, 0.5, 2.0}
    for spec, fix in (("lognormal:x", "lognormal:MEAN_SECONDS:SIGMA"), ("gamma:1", "trace:PATH"),
                      (f"trace:{tmp_path / 'none'}", "no file"), ("lognormal:-1:1", ">= 0")):
        with pytest.raises(ValueError, match=fix):
            latency_sampler(spec)
    with pytest.raises(ValueError, match="--latency"):
        Args(latency="nope")


def test_turns_are_heavy_tailed_per_row_and_the_last_answer_is_scored():
    rows = make_dataset(400, seed=0)
    bases = [HeavyTailEnv(row, latency="lognormal:0:1", alpha=1.2, max_turns=8).base for row in rows]
    assert min(bases) == 1 and max(bases) == 8 and statistics.median(bases) == 1  # most short, a few at the cap
    env = HeavyTailEnv(rows[0], latency="lognormal:0:1", alpha=1.2, max_turns=8)
    env.reset(seed=0, options={})
    turns, done = 0, False
    while not done:
        obs, reward, done, truncated, _ = env.step("A: 0")
        turns += 1
    assert turns == env.need in (env.base, env.base + 1) and reward in (0.0, 1.0) and not truncated
