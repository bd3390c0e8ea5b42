"""README.md's Python examples run as written.

Every ```python block of README.md is executed in a fresh Python process (its own
namespace, the CPU backend, the repository first on the path), so an example that
no longer matches the library fails here instead of in a user's first session.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK_TIMEOUT_S = 900          # the Engine example compiles a serving step (up to ~30 s on a CPU)

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, source) of every ```python block of a markdown text."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def run_block(code: str, timeout_s: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run `code` as a script in a new process, from the repository root, on the CPU."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2, f"expected the ops and Engine examples in {README}, found {len(BLOCKS)} blocks"


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code):
    r = run_block(code)
    assert r.returncode == 0, (f"the README.md block at line {line} exited with {r.returncode}\n"
                               f"--- stdout (end) ---\n{r.stdout[-2000:]}\n"
                               f"--- stderr (end) ---\n{r.stderr[-6000:]}")


def test_block_extraction_and_a_failing_block():
    """The harness itself: it finds blocks in their order with their line numbers, skips
    other languages, and a block that raises is reported as a failure."""
    text = "intro\n```python\nx = 1\n```\n```bash\nexit 1\n```\n```python\nraise ValueError('no')\n```\n"
    blocks = python_blocks(text)
    assert blocks == [(2, "x = 1\n"), (8, "raise ValueError('no')\n")]
    assert run_block(blocks[0][1], timeout_s=120).returncode == 0
    failed = run_block(blocks[1][1], timeout_s=120)
    assert failed.returncode != 0 and "ValueError" in failed.stderr
