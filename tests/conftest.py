import atexit
import gc
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

# XLA CPU flags for the test processes, set before jax starts its backend. The CPU tests
# spend most of their time compiling (the interpret-mode kernels, the engine's step), and
# XLA's legacy CPU emitters compile those programs faster than its fusion emitters, with
# the same results (measured: 545 against 790 s for the suite in two workers, the same
# tests passing both ways, the engine's step running no slower). Lower LLVM
# optimization levels compile faster still but run the engine's steps 2-10x slower.
# test_write_bytes_do_not_depend_on_the_cpu_emitters holds the writes' bytes equal under both.
# Set only where a probe process shows the backend is the CPU and this jax accepts the
# flag (an unknown XLA flag aborts the process); the xdist workers, the notebooks'
# kernels and the sharding scripts inherit it through the environment.
TEST_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"
FLAGS_PROBED_ENV = "GLM5_TEST_XLA_FLAGS_PROBED"


def _set_test_xla_flags():
    if os.environ.get(FLAGS_PROBED_ENV):
        return
    os.environ[FLAGS_PROBED_ENV] = "1"
    flags = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):         # no verdict: the tests run without the flag
        return
    if probe.returncode == 0 and probe.stdout.split()[-1:] == ["cpu"]:
        os.environ["XLA_FLAGS"] = flags
        os.environ[FLAGS_PROBED_ENV] = "set"


_set_test_xla_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"

# On the CPU, one persistent compilation cache per test run, shared by the pytest-xdist
# workers and the notebooks' kernels (they inherit the environment): tests in different
# processes that compile the same program (the engine's step at the tests' shapes, the
# interpret-mode kernels) compile it once (measured: 708 s for a clean-clone CI run with
# it against 803 s without). The controller process makes the directory before the
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


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Free JAX's trace and compile caches and collect once, before the process reports
    the session finished.

    By then a worker's heap holds a million or more objects, most of them cached jaxprs,
    and a full collection of it takes over a second on the 2-core CI machine. pytest's
    cleanup after the session runs five (to surface unraisable exceptions), and an
    xdist worker runs them after it has told the controller it is done: when they take
    longer than the 5 s execnet allows a terminating worker, execnet sends the worker a
    SIGINT, and the KeyboardInterrupt lands in whatever runs then, typically hypothesis's
    gc callback, where pytest reports it as a PytestUnraisableExceptionWarning. No test
    runs after this hook, so nothing needs the caches any more; xdist reports the worker
    finished only after every plain sessionfinish hook has run."""
    jax.clear_caches()
    gc.collect()


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
