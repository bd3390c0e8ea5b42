import os
import secrets

import jax
import numpy as np
import pytest

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU backend (compiled Pallas kernels)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is printed so a failure can be replayed
    with GLM5_SEED=<seed>."""
    seed = int(os.environ.get("GLM5_SEED", secrets.randbits(32)))
    print(f"\n[{request.node.name}] GLM5_SEED={seed}")
    return np.random.default_rng(seed)


import sys as _sys  # noqa: E402
import pathlib as _pathlib  # noqa: E402
_sys.path.insert(0, str(_pathlib.Path(__file__).parent))   # tests/vectors.py importable as `vectors`
