"""The README is the user's manual: at most 200 lines, and every ```python block in it runs as written.

Each block runs on its own, in a fresh interpreter (``sys.executable -c``) in an empty directory, the way a
reader pastes it: nothing defined by an earlier block, no plan cache, no budget from the environment. A block
that needs torchrun or a GPU has no place in a ```python fence (the README shows those as ```bash).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_LINES = 200
TIMEOUT_S = 120
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks() -> list[tuple[str, int, str]]:
    """Every fenced block of the README: (its language tag, the line its fence opens on, its code)."""
    text = README.read_text(encoding="utf-8")
    return [(m.group(1).strip(), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)]


PYTHON = [(line, code) for tag, line, code in _blocks() if tag == "python"]


def test_the_readme_is_a_manual_of_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, (f"README.md has {len(lines)} lines; the manual is at most {MAX_LINES}: move "
                                     "measurements and design notes to docs/")


def test_every_python_block_is_tagged_python():
    """A block tagged ``py``, ``python3`` or ``pycon`` would escape the test below: the README says ``python``."""
    tags = {tag for tag, _, _ in _blocks()}
    assert not {t for t in tags if t.lower().startswith("py") and t != "python"}, tags
    assert len(PYTHON) >= 5, "the Use section's recipes are python blocks"


@pytest.mark.slow
@pytest.mark.parametrize("line,code", PYTHON, ids=[f"README.md:{line}" for line, _ in PYTHON])
def test_python_block_runs_as_written(line, code, tmp_path):
    env = dict(os.environ, KARMA_PROGRESS="0")
    for name in ("KARMA_BUDGET", "KARMA_PLAN_CACHE", "PYTHONSTARTUP"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    shown = f"README.md:{line}, exit {out.returncode}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-5000:]}"
    assert out.returncode == 0, shown
    assert "Traceback" not in out.stdout + out.stderr, shown
