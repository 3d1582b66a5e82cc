"""docs/reference.md is the config's settings, generated: it must match the config of this commit."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from rollpacker.reference import COMMAND, reference, sections

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def test_reference_is_up_to_date():
    text = reference()
    assert "`--schedule.eta-prompts`" in text and "`--reward.judge.max-score`" in text
    if text != REFERENCE.read_text():
        pytest.fail(f"docs/reference.md is out of date with the config: regenerate it with `{COMMAND}`")


def test_undocumented_setting_is_refused_by_name():
    @dataclass(kw_only=True)
    class Bare:
        size: int = 1
        """Documented."""
        depth: int = 2

    with pytest.raises(ValueError, match=r"Bare\.depth has no docstring.*rollpacker\.reference"):
        sections(Bare, Bare(), "bare.", "bare", "")
