"""Repository hygiene that CI enforces: the README's commands, lint and types."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S)
    assert block, "README has no 'Two commands' block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_two_commands_and_ci_runs_the_test_one() -> None:
    up, test = readme_commands()
    assert "flotilla up" in up
    assert "pytest" in test
    assert test in (ROOT / ".ci" / "run").read_text(), ".ci/run must run the README's test command"


def test_console_script_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'flotilla = "services.launcher.cli:main"' in text
    from services.launcher.cli import main  # noqa: F401  (importable)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extras")
def test_ruff_clean() -> None:
    r = subprocess.run(["ruff", "check", "libs", "services", "kernels", "tests", "bench"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]
