"""Run on 3 gloo ranks by tests/dist/test_exchange.py: rank 0 scatters parts of very different sizes (one
shared by two ranks); each rank gets its own part, a copy, and holds no buffer the size of another's."""

import resource

from rollpacker.dist import build_meshes, exit_process

meshes = build_meshes()
rank, big = meshes.rank, b"x" * 100_000_000
shared = {"part": "shared", "ids": [2**62, -(2**63)]}
parts = [shared, shared, {"part": "big", "blob": big}] if rank == 0 else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
got = meshes.scatter(parts)
grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
if rank == 0:
    assert got == shared and got is not shared, got
elif rank == 1:
    assert got == shared, got
    assert grew_mb < 50, f"rank 1 received 1 part of ~100 bytes and grew {grew_mb:.0f} MB"
else:
    assert got["blob"] == big
print(f"rank {rank} OK", flush=True)
exit_process(0)
