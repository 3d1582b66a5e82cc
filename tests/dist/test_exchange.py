"""The exchange on real gloo ranks: what each rank is sent and what comes back."""

from __future__ import annotations

from support.jobs import torchrun


def test_each_replica_gets_only_its_requests_and_reports_come_back_whole(qwen3_tied_dir):
    """4 ranks, two TP-2 TorchEngine replicas, a tail round (aborts too): both ranks of a replica get the same
    part, the replicas' parts are disjoint and cover the round, and each kept response has its prompt and the
    tokens its request gives alone."""
    out = torchrun("exchange_tp.py", 4, str(qwen3_tied_dir))
    assert out.count("OK") == 1, out


def test_a_scatter_sends_each_rank_its_own_part_alone():
    """3 ranks: rank 0 keeps a copy of its part, rank 1 a small part, rank 2 one of 100 MB; rank 1 never holds a
    buffer the size of rank 2's (torch's scatter_object_list pads every part to the largest)."""
    out = torchrun("scatter.py", 3)
    assert sorted(line for line in out.splitlines() if "OK" in line) == ["rank 0 OK", "rank 1 OK", "rank 2 OK"], out
