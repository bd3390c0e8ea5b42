"""Jit-compiled wrappers of the XLA reference ops, shared by the CPU test files.

The reference specialises on the layout (static), so every distinct (layout,
shape) pair is one compile of a few seconds on CPU. Keeping one jitted object per
op here lets test files reuse each other's compiles in one pytest session; tests
should reuse layouts and pad batches to fixed shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax import reference as ref
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario

# A small layout (kpool 4, ring 8 = num_spec_tokens 3, one 32-row page per block) shared
# by several tests with fixed shapes: flat batches of SMALL_T rows, decode [1, SMALL_W].
SMALL_LAYOUT = CacheLayout(IndexerConfig(kpool=4, num_spec_tokens=3, block_size=128),
                           num_layers=1, num_blocks=4)
SMALL_T = 8
SMALL_W = 4

_STATIC = dict(static_argnums=(1, 2), static_argnames=("implementation",))

_seed = jax.jit(ops.seed_tail, **_STATIC)
_compress = jax.jit(ops.compress_prefill, **_STATIC)
_decode = jax.jit(ops.decode_update, **_STATIC)

# strides-level reference entry points (used with injected faults)
seed_tail_strides = jax.jit(ref.seed_tail_strides, static_argnums=1)
compress_prefill_strides = jax.jit(ref.compress_prefill_strides, static_argnums=1)
decode_update_strides = jax.jit(ref.decode_update_strides, static_argnums=1)


def seed(cache, layout, layer, key, gate, tslot):
    return _seed(cache, layout, layer, jnp.asarray(key), jnp.asarray(gate), jnp.asarray(tslot),
                 implementation="xla")


def compress(cache, layout, layer, key, gate, ape, slot_mapping):
    return _compress(cache, layout, layer, jnp.asarray(key), jnp.asarray(gate),
                     jnp.asarray(ape, jnp.float32), jnp.asarray(slot_mapping), implementation="xla")


def decode(cache, layout, layer, key, gate, ape, slot_mapping, tslot, positions):
    return _decode(cache, layout, layer, jnp.asarray(key), jnp.asarray(gate),
                   jnp.asarray(ape, jnp.float32), jnp.asarray(slot_mapping), jnp.asarray(tslot),
                   jnp.asarray(positions), implementation="xla")


def prefill(cache, layout, layer, ape, batch):
    """Pool compression then tail seed of one flat prefill batch (the vLLM order)."""
    cache = compress(cache, layout, layer, batch["key"], batch["gate"], ape, batch["slot_mapping"])
    return seed(cache, layout, layer, batch["key"], batch["gate"], batch["tslot"])


def decode_step(cache, layout, layer, ape, step):
    return decode(cache, layout, layer, step["key"], step["gate"], ape, step["slot_mapping"],
                  step["tslot"], step["positions"])


def as_bytes(cache) -> np.ndarray:
    """Little-endian bytes of the flat cache (a copy, safe against donation)."""
    return np.array(cache).view(np.uint8)


# Scenario.golden_pools is jit-compiled and padded to multiples of 64 pools already.
GoldenScenario = Scenario
