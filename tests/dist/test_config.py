"""Presets, flags and config errors: all before torch is imported."""

from __future__ import annotations

import subprocess
import sys


def test_help_and_errors_return_before_torch_is_imported():
    code = ("import sys\nfrom rollpacker.run import main\n"
            "try:\n    main(['--rollout.temperature', '-1'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported while parsing'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "temperature" in proc.stderr
