"""Metrics helpers against hand-computed values, the JSONL/wandb sink, the live display, the report."""

from __future__ import annotations

import subprocess
import sys


def test_report_module_entry_point_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rollpacker.report", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
