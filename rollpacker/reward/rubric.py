"""The judge's rubric: a prompt template with ``{prompt}`` and ``{response}``, checked where it is given
(``reward.judge.rubric``, or a dataset row's own ``rubric``). Light: reward workers import it."""

from __future__ import annotations


def check_rubric(rubric: str, name: str = "judge.rubric") -> None:
    """Raise a ValueError naming ``name`` unless ``rubric`` is a template with {prompt} and {response}."""
    try:
        rubric.format(prompt="", response="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{name} is not a valid template ({type(e).__name__}: {e}); "
                         "use only {prompt} and {response}, and double other braces") from None
    for key in ("{prompt}", "{response}"):
        if key not in rubric:
            raise ValueError(f"{name} must contain {key}")
