"""Benchmarks: ``python -m rollpacker.bench <name> [--flags]`` (see ``__main__``); their jobs' flags
are :mod:`rollpacker.jobflags`, which the simulator shares."""
