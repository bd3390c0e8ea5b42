import atexit
import os
import secrets
import shutil
import tempfile

import jax
import numpy as np
import pytest

ON_GPU = jax.default_backend() == "gpu"

# On the CPU, one persistent compilation cache per test run, shared by the pytest-xdist
# workers and the notebooks' kernels (they inherit the environment): tests in different
# processes that compile the same program (the engine's step at the tests' shapes, the
# interpret-mode kernels) compile it once. A clean-clone .ci/run took 708 s with it against
# 803 s without (session 21). The controller process makes the directory before the
# workers start (they find it in the environment) and removes it at exit; a
# JAX_COMPILATION_CACHE_DIR set by the caller is used as it is. GPU runs keep no cache.
if not ON_GPU and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="glm5_jax_tests_xla_")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


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
