"""Benchmarks: ``python -m rollpacker.bench <name> [--flags]`` (see ``__main__``); their jobs' flags
are :mod:`rollpacker.jobflags`, which the simulator shares."""


def seed_list(text: str) -> list[int]:
    """``--seeds``: comma-separated integers; anything else is a ValueError saying how to write them."""
    try:
        return [int(seed) for seed in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: write comma-separated integers (0,1,2)") from None
