"""The judge's rubric: a prompt template with ``{prompt}`` and ``{response}``, checked where it is given
(``reward.judge.rubric``, or a dataset row's own ``rubric``). Light: reward workers import it."""

from __future__ import annotations

from string import Formatter


def check_rubric(rubric: str, name: str = "judge.rubric") -> None:
    """Raise a ValueError naming ``name`` unless ``rubric`` is a template whose only fields are {prompt} and
    {response}, each at least once (a doubled ``{{prompt}}`` is literal text, not the field)."""
    try:
        fields = {field for _, field, _, _ in Formatter().parse(rubric) if field is not None}
        bad = sorted("{" + f + "}" for f in fields - {"prompt", "response"})
        if not bad:
            rubric.format(prompt="", response="")  # a bad format spec: {prompt:d}
    except ValueError as e:
        bad = [str(e)]
    if bad:
        raise ValueError(f"{name} is not a valid template ({', '.join(bad)}); "
                         "use only {prompt} and {response}, and double other braces")
    for key in ("prompt", "response"):
        if key not in fields:
            raise ValueError(f"{name} must contain {{{key}}}")
