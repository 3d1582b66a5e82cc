"""The set of config options is frozen (as torchtitan's test_no_new_cli_options): adding, renaming or
removing one is a deliberate edit of ``config_options.txt``, reviewed with the change.

Regenerate the file after such a change (see docs/extending.md):

    python tests/unit/test_config_options.py > tests/unit/config_options.txt
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import get_type_hints

FROZEN = Path(__file__).with_name("config_options.txt")
REGENERATE = "python tests/unit/test_config_options.py > tests/unit/config_options.txt"


def options(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every option of the root config as a dotted name; a policy's settings as ``schedule:NAME.setting``."""
    from rollpacker.config import Config
    from rollpacker.schedule import config as policies

    cls = cls or Config
    hints = get_type_hints(cls, include_extras=True)
    names = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is policies.ScheduleConfig:
            names += [o for name, policy in policies.POLICY_CONFIGS.items()
                      for o in options(policy, f"{prefix}schedule:{name}.")]
        elif dataclasses.is_dataclass(hint):
            names += options(hint, f"{prefix}{f.name}.")
        else:
            names.append(prefix + f.name)
    return names


def test_no_new_config_options():
    current, frozen = set(options()), set(FROZEN.read_text().split())
    added, removed = sorted(current - frozen), sorted(frozen - current)
    assert not added and not removed, (
        f"the config options changed: added {added or 'none'}, removed {removed or 'none'}. If that is intended, "
        f"regenerate the frozen set with `{REGENERATE}` and commit it with the change")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    print("\n".join(options()))
