"""Benchmarks: ``python -m rollpacker.bench <name> [--flags]`` (see ``__main__``)."""
