"""Scale-out over several devices (glm5_jax.serving.sharding, Engine on a mesh).

The device count is fixed when jax starts, so the multi-device cases run in a
subprocess: on forced CPU devices (``--xla_force_host_platform_device_count``),
or on real GPUs when this process runs on a GPU backend with enough of them
(then the subprocess sees the GPUs; ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` lets
it share them with this process).

* scripts/sharded_writes.py: per-shard cache writes under shard_map equal the same
  requests written to one unsharded cache, and every shard holds its golden pools;
* scripts/sharded_engine.py: the Engine on a mesh: placement (least loaded,
  re-hit to the owner shard), per-shard tokens, selections and cache bytes equal
  to one-device runs, one compiled program with the cache in place and no
  cross-device op in its HLO, the serving probe on every shard, and admission
  first come first served per shard (a request waiting for its busy prefix owner
  does not hold back one another shard can take).

The bad-input checks run in process.
"""
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from glm5_jax import simulate
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.model.decoder import Decoder, ModelConfig
from glm5_jax.serving import sharding
from glm5_jax.serving.engine import Engine

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
REPO = pathlib.Path(__file__).resolve().parent.parent
ON_GPU = jax.default_backend() == "gpu"


def _run(script: str, devices: int, *args, timeout=600):
    """Run a script with `devices` devices: real GPUs if this backend has them, else forced CPUs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if not (ON_GPU and jax.device_count() >= devices):
        env.update(XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip(),
                   JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(SCRIPTS / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _report(r, what):
    return f"{what}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"


# 2 devices only: the 4-device cases (~55 s of CI's 15-minute budget) add no code path
# the 2-device ones miss
@pytest.mark.parametrize("impl, devices", [("xla", 2), ("pallas", 2)])
def test_sharded_writes_equal_single_device(rng, impl, devices):
    seed = int(rng.integers(0, 2**31))
    r = _run("sharded_writes.py", devices, impl, seed)
    assert r.returncode == 0 and f"OK {devices}" in r.stdout, _report(r, f"seed {seed}")


@pytest.mark.parametrize("devices", [2])
def test_sharded_engine_equals_one_device_per_shard(rng, devices):
    seed = int(rng.integers(0, 2**31))
    r = _run("sharded_engine.py", devices, seed, devices)
    assert r.returncode == 0 and f"OK {devices}" in r.stdout, _report(r, f"seed {seed}")


# ---------------------------------------------------------------------------------
# bad input (in process, one device)
# ---------------------------------------------------------------------------------
TINY = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=1, head_dim=32, q_lora_rank=32,
                   mlp_size=32, indexer=IndexerConfig(n_heads=1, topk=32, block_size=64))


def test_mesh_and_cache_are_checked():
    dev = np.asarray(jax.devices()[:1])
    with pytest.raises(ValueError, match="'data' axis"):
        sharding.check_mesh(Mesh(dev, ("x",)))
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        sharding.check_mesh(jax.devices())
    mesh = sharding.single_device_mesh()
    assert sharding.check_mesh(mesh) == 1 and sharding.check_mesh(Mesh(dev.reshape(1, 1), ("data", "x"))) == 1
    layout = CacheLayout(IndexerConfig(block_size=128), num_layers=1, num_blocks=4)
    with pytest.raises(ValueError, match=r"leading axis \(2\) must equal the mesh's 'data' axis size \(1\)"):
        sharding.check_cache(np.zeros((2, layout.total_words), np.uint32), layout, mesh)
    with pytest.raises(ValueError, match="shape"):
        sharding.check_cache(layout.allocate(), layout, mesh)
    key = np.zeros((2, 8, 128), jax.numpy.bfloat16)
    with pytest.raises(ValueError, match="leading axis"):
        sharding.seed_tail(np.zeros((2, layout.total_words), np.uint32), mesh, layout, 0, key, key,
                           np.zeros((2, 8), np.int32))
    with pytest.raises(ValueError, match="leading axis of 1"):
        sharding.put_per_shard({"a": np.zeros((2, 3))}, mesh)
    cache = sharding.allocate(layout, mesh, 0xA5)
    assert cache.shape == (1, layout.total_words)
    assert (sharding.host_shard(cache, 0).view(np.uint8) == 0xA5).all()
    with pytest.raises(ValueError, match="not a row"):
        sharding.host_shard(cache, 1)


def test_engine_mesh_default_and_bad_mesh():
    model = Decoder.random(TINY)
    e = Engine(model, 6)
    assert e.num_shards == 1 and e.cache.shape == (1, e.layout.total_words)
    assert e.block_pool is e.block_pools[0] and e.stats()["shards"][0]["shard"] == 0
    with pytest.raises(ValueError, match="'data' axis"):
        Engine(model, 6, mesh=Mesh(np.asarray(jax.devices()[:1]), ("x",)))
    with pytest.raises(ValueError, match="dry-run engine has no cache"):
        Engine(model, 6, dry_run=True).cache_bytes()


def test_simulate_needs_the_devices_it_asks_for(capsys):
    w = simulate.preset("cpu", devices=len(jax.devices()) + 1)
    with pytest.raises(ValueError, match="devices requested but jax sees"):
        simulate.run_workload(w)
    assert simulate.main(["--devices", str(len(jax.devices()) + 1), "--no-progress"]) == 2
    assert "xla_force_host_platform_device_count" in capsys.readouterr().err
    with pytest.raises(ValueError, match="devices must be >= 1"):
        simulate.preset("cpu", devices=0)


def test_cache_traffic_reads_compiled_programs():
    """The HLO reader behind the in-place checks finds what it looks for."""
    layout = CacheLayout(IndexerConfig(block_size=128), num_layers=1, num_blocks=4)
    mesh = sharding.single_device_mesh()
    update = jax.jit(lambda c: c.at[0, 5].set(7), donate_argnums=0)
    t = sharding.cache_traffic(update.lower(sharding.allocate(layout, mesh)).compile().as_text(), layout)
    assert t == dict(cross_device=[], cache_copies=[], cache_aliased=True)
    keep_old = jax.jit(lambda c: (c.at[0, 5].set(7), c + 0))              # old value still needed
    t = sharding.cache_traffic(keep_old.lower(sharding.allocate(layout, mesh)).compile().as_text(), layout)
    assert not t["cache_aliased"]
    keep_both = jax.jit(lambda c: (c.at[0, 5].set(7), c), donate_argnums=0)
    t = sharding.cache_traffic(keep_both.lower(sharding.allocate(layout, mesh)).compile().as_text(), layout)
    assert t["cache_copies"], "a donated cache returned twice must be copied"
    fake = "  %all-gather.3 = u32[2,8]{1,0} all-gather(u32[1,8]{1,0} %p), dimensions={0}\n"
    assert sharding.cache_traffic(fake, layout)["cross_device"] == [fake.strip()]
