"""The exchange on real gloo ranks: what each rank is sent and what comes back."""

from __future__ import annotations

from support.jobs import torchrun


def test_each_replica_gets_only_its_requests_and_reports_come_back_whole(qwen3_tied_dir):
    """4 ranks, two TP-2 TorchEngine replicas, a tail round (aborts too): both ranks of a replica get the same
    part, the replicas' parts are disjoint and cover the round, and each kept response has its prompt and the
    tokens its request gives alone."""
    out = torchrun("exchange_tp.py", 4, str(qwen3_tied_dir))
    assert out.count("OK") == 1, out
