"""docs/reference.md is the config's settings, generated: it must match the config of this commit."""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from rollpacker.reference import COMMAND, preset_changes, reference, sections

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


def test_each_presets_changes_are_toml_keys():
    """They said a tuple as Python writes it (``('math',)``), which no TOML file takes."""
    keys = [key for line in preset_changes() for key in re.findall(r"`([\w.]+ = [^`]+)`", line)]
    assert any(key.startswith("reward.funcs = ") for key in keys)
    for key in keys:
        tomllib.loads(key)
