"""sha256 of the cache bytes that one random write workload leaves, through the XLA
reference and through the interpret-mode Pallas kernels.

tests/test_write_kernels.py compares the digest of its own process (XLA CPU flags as
tests/conftest.py sets them) with one from a process that runs without them, so the
bytes of the cache writes do not depend on which of XLA's CPU emitters compiled them.

    python tests/scripts/write_digest.py SEED [CASE_INDEX]
"""
from __future__ import annotations

import hashlib
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))      # tests/: write_cases

from write_cases import CASES, ops_writers, random_workload, run_writes  # noqa: E402


def digest(seed: int, case: int = 1) -> str:
    cfg, lay = CASES[case].values
    layout, sc, pre, steps, _ = random_workload(np.random.default_rng(seed), cfg, lay)
    h = hashlib.sha256()
    for impl in ("xla", "pallas"):
        cache, snaps = run_writes(ops_writers(impl), layout, lay["layer"], sc, pre, steps)
        h.update(np.asarray(cache).tobytes())
        for snap in snaps:
            h.update(np.asarray(snap).tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    print(digest(int(sys.argv[1]), *(int(a) for a in sys.argv[2:3])))
