"""Scale-out groundwork: one cache shard per device, cache ops under ``shard_map``.

The flat buffer gets a leading device axis: ``uint32[num_devices, total_words]``,
sharded over the mesh's ``data`` axis, so device d owns row d: its own blocks,
its own tail rings, with the same per-device ``CacheLayout`` (block ids are local
to a shard). Every cache op runs per shard under ``jax.shard_map`` with that
shard's metadata (a leading device axis on every argument); nothing moves cache
bytes between devices, and the cache stays donated.

This is the kernel-level layer of the multi-GPU issue. The Engine does not use it
yet (one BlockPool per shard and request placement are still to do).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import ops
from .layout import CacheLayout

AXIS = "data"


def data_mesh(devices=None) -> Mesh:
    """A 1-D mesh over `devices` (default: all local devices) with axis ``data``."""
    devs = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devs.reshape(-1), (AXIS,))


def allocate(layout: CacheLayout, mesh: Mesh, fill_byte: int = 0):
    """uint32[num_devices, total_words], row d on device d (every byte = fill_byte)."""
    n = mesh.shape[AXIS]
    word = np.uint32(fill_byte * 0x01010101)
    sharding = NamedSharding(mesh, P(AXIS, None))
    return jax.jit(lambda: jax.numpy.full((n, layout.total_words), word, jax.numpy.uint32),
                   out_shardings=sharding)()


def _per_shard(op, mesh: Mesh, n_args: int, **kw):
    """op(cache_shard, *args_shard, **kw) for every device: leading device axis on all."""
    spec = P(AXIS)

    def body(cache, *args):            # cache [1, words] and args [1, ...] on each device
        out = op(cache[0], *(a[0] for a in args), **kw)
        return out[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (1 + n_args), out_specs=spec,
                         check_vma=False)


def seed_tail(cache, mesh: Mesh, layout: CacheLayout, layer: int, key, gate, tslot, **kw):
    """ops.seed_tail per shard: cache [D, words]; key, gate [D, T, 128]; tslot [D, T]."""
    f = functools.partial(ops.seed_tail, layout=layout, layer=layer, **kw)
    return _per_shard(lambda c, k, g, t: f(c, key=k, gate=g, tslot=t), mesh, 3)(cache, key, gate, tslot)


def compress_prefill(cache, mesh: Mesh, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, **kw):
    """ops.compress_prefill per shard: ape [D, R, 128] (the same layer weights on every shard)."""
    f = functools.partial(ops.compress_prefill, layout=layout, layer=layer, **kw)
    return _per_shard(lambda c, k, g, a, s: f(c, key=k, gate=g, ape=a, slot_mapping=s), mesh, 4)(
        cache, key, gate, ape, slot_mapping)


def decode_update(cache, mesh: Mesh, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, tslot,
                  positions, **kw):
    """ops.decode_update per shard: [D, B, n, ...] arguments."""
    f = functools.partial(ops.decode_update, layout=layout, layer=layer, **kw)
    return _per_shard(lambda c, k, g, a, s, t, p: f(c, key=k, gate=g, ape=a, slot_mapping=s, tslot=t,
                                                    positions=p), mesh, 6)(
        cache, key, gate, ape, slot_mapping, tslot, positions)
