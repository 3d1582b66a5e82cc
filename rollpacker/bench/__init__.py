"""Benchmarks: ``python -m rollpacker.bench <name> [--flags]`` (see ``__main__``)."""


def split_run_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """A benchmark's own flags, and the ``rollpacker.run`` flags that follow ``--``."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
