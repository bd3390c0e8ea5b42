"""Per-device cache shards under shard_map (glm5_jax.sharding) on forced CPU devices:
each shard's bytes equal the same requests written to one unsharded cache, and each
shard holds exactly its golden pools and tails with no stray byte. The device count
is fixed when jax starts, so each case runs in a subprocess."""
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "sharded_writes.py"


@pytest.mark.parametrize("impl, devices", [("xla", 2), ("pallas", 2), ("xla", 4)])
def test_sharded_writes_equal_single_device(rng, impl, devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    seed = int(rng.integers(0, 2**31))
    r = subprocess.run([sys.executable, str(SCRIPT), impl, str(seed)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and f"OK {devices}" in r.stdout, (
        f"seed {seed}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}")
