"""The code passes `ruff check` (the rules are in pyproject.toml): part of the README's test command."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: scripts/setup.sh installs it with the test extras (pip install -e '.[test]')")
    p = subprocess.run([ruff, "check", "--no-cache", "src", "tests", "scripts", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
