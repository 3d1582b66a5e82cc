"""Benchmarks: ``python -m rollpacker.bench <name> [--flags]`` (see ``__main__``); their jobs' flags
are :mod:`rollpacker.jobflags`, which the simulator shares."""


def seed_list(text: str) -> list[int]:
    """``--seeds``: comma-separated integers; anything else is a ValueError saying how to write them."""
    try:
        return [int(seed) for seed in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: write comma-separated integers (0,1,2)") from None


def ratio(a: float, b: float) -> float:
    """``a / b`` to 3 decimals; NaN where ``b`` measured nothing (a JSON line writes it null)."""
    return round(a / b, 3) if b > 0 else float("nan")


def json_line(figures: dict) -> str:
    """The headline figures as one JSON line, NaN (nothing measured) as null: JSON has no NaN."""
    import json

    return json.dumps({k: None if v != v else v for k, v in figures.items()})
