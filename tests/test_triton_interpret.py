"""The Triton-language kernels run by Triton's interpreter on the CPU.

The kernels of implementation="triton" (the writes, the tensor-core logits and their
group maxima, the row top-k of prefill rows, the decode split top-k, the sampled top-k,
and select_tokens through them: prefill rows in windows, decode rows) compile for the
GPU only; their compiled tests (test_triton.py, test_tc_read.py) run
on a GPU machine. Here tests/scripts/triton_dev_check.py runs the same kernels,
launched by the same planning code, in Triton's interpreter (TRITON_INTERPRET=1,
numpy memory) and compares their bytes and ids with glm5_jax.reference, so a change
to a kernel's logic, its planning or its launch shows on every machine. The
interpreter runs a grid's programs one after another: races, missing barriers and the
GPU's rounding of a dot show only in the compiled tests.

Each group of checks runs in a process of its own: TRITON_INTERPRET must be set
before triton is imported, and no other test imports it. Needs triton 3.6.0 (the GPU
machine's version; the script patches three conversions of its interpreter), which
the `[test]` extra installs where triton has wheels (Linux on x86_64 and aarch64); elsewhere the
tests skip, saying so. On a GPU machine the compiled tests cover these kernels and
benchmarks/gpu.sh leaves this file out.
"""
import importlib.util
import os
import pathlib
import platform
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "triton_dev_check.py"
TRITON_PIN = "3.6.0"
GROUPS = ("writes", "row-topk", "logits-split-topk", "select-tokens")


def _triton_version():
    if importlib.util.find_spec("triton") is None:
        return None
    from importlib.metadata import version
    return version("triton")


def _require_triton():
    found = _triton_version()
    if found == TRITON_PIN:
        return
    has_wheels = platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")
    why = f"triton {TRITON_PIN} is needed" + (f", found {found}" if found else ", not installed")
    if has_wheels:
        pytest.fail(f"{why}: pip install -e '.[test]' installs it here")
    pytest.skip(f"{why}; triton has no wheels for {platform.system()} on {platform.machine()}")


@pytest.mark.parametrize("group", GROUPS)
def test_triton_kernels_match_the_reference_in_the_interpreter(rng, group):
    _require_triton()
    seed = int(rng.integers(2**32))
    run = subprocess.run([sys.executable, str(SCRIPT), "interpret", "--only", group, "--seed", str(seed)],
                         capture_output=True, text=True, timeout=1200)   # the script puts the repo on sys.path
    print(run.stdout[-6000:], run.stderr[-3000:])
    assert run.returncode == 0, f"{group}: rc {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.rstrip().endswith("TRITON DEV CHECK: passed"), run.stdout[-2000:]
    assert ": ok" in run.stdout, f"{group}: no check reported ok\n{run.stdout[-2000:]}"


def test_the_interpreter_check_refuses_an_unknown_group():
    _require_triton()
    run = subprocess.run([sys.executable, str(SCRIPT), "interpret", "--only", "nonsense"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "unknown group" in run.stderr
