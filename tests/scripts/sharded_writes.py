"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=N: per-shard cache writes
under shard_map equal the same requests written to one unsharded cache, shard by shard,
and every shard holds its golden pools with no stray byte. Prints 'OK <n>' on success."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.serving import sharding
from glm5_jax.testing import Scenario

impl = sys.argv[1]
seed = int(sys.argv[2])
rng = np.random.default_rng(seed)
mesh = sharding.data_mesh()
d = mesh.shape[sharding.AXIS]
assert d == len(jax.devices()) > 1, "needs several devices"
layout = CacheLayout(IndexerConfig(block_size=128, num_spec_tokens=1), num_layers=2, num_blocks=10)
R, SENT, LAYER = 4, 0x5A, 1
scs, pres, steps, upto = [], [], [], []
for _ in range(d):                                  # different requests on every shard, same shapes
    lengths = [int(x) for x in rng.integers(R + 1, 60, size=2)]
    counts = [int(rng.integers(0, 5)) for _ in lengths]
    sc = Scenario.random(rng, layout, [L + 8 for L in lengths], layer=LAYER)
    scs.append(sc)
    pres.append(sc.prefill(lengths, pad_to=128))
    steps.append(sc.decode(lengths, counts, 4))
    upto.append([L + n for L, n in zip(lengths, counts)])
stack = lambda xs, k: jnp.asarray(np.stack([x[k] for x in xs]))
apes = jnp.asarray(np.stack([sc.ape for sc in scs]))

cache = sharding.allocate(layout, mesh, SENT)
donate = dict(donate_argnums=0)
step_pre = jax.jit(lambda c, k, g, a, s, t: sharding.seed_tail(
    sharding.compress_prefill(c, mesh, layout, LAYER, k, g, a, s, implementation=impl),
    mesh, layout, LAYER, k, g, t, implementation=impl), **donate)
step_dec = jax.jit(lambda c, k, g, a, s, t, p: sharding.decode_update(
    c, mesh, layout, LAYER, k, g, a, s, t, p, implementation=impl), **donate)
cache = step_pre(cache, stack(pres, "key"), stack(pres, "gate"), apes, stack(pres, "slot_mapping"),
                 stack(pres, "tslot"))
cache = step_dec(cache, stack(steps, "key"), stack(steps, "gate"), apes, stack(steps, "slot_mapping"),
                 stack(steps, "tslot"), stack(steps, "positions"))
assert cache.sharding.spec[0] == sharding.AXIS
got = np.asarray(cache)
for i, (sc, pre, st) in enumerate(zip(scs, pres, steps)):
    one = layout.allocate(SENT)
    one = ops.compress_prefill(one, layout, LAYER, jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]),
                               jnp.asarray(sc.ape), jnp.asarray(pre["slot_mapping"]), implementation=impl)
    one = ops.seed_tail(one, layout, LAYER, jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]),
                        jnp.asarray(pre["tslot"]), implementation=impl)
    one = ops.decode_update(one, layout, LAYER, *(jnp.asarray(st[k]) for k in ("key", "gate")),
                            jnp.asarray(sc.ape), *(jnp.asarray(st[k]) for k in ("slot_mapping", "tslot", "positions")),
                            implementation=impl)
    np.testing.assert_array_equal(got[i].view(np.uint8), np.asarray(one).view(np.uint8),
                                  err_msg=f"shard {i} differs from the single-device run")
    sc.check_cache(got[i], upto[i], SENT)          # golden pools and tails, sentinel elsewhere
print("OK", d)
