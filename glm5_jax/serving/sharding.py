"""Scale-out: one cache shard per device, every cache op per shard under ``shard_map``.

The cache of D devices is ONE array ``uint32[D, total_words]`` sharded over the
``data`` axis of a 1-D ``jax.sharding.Mesh``: device d owns row d, a complete
single-device cache with the same ``CacheLayout`` (so block ids, strides and
kernels are unchanged and local to a shard). Every per-device argument carries
the same leading device axis (row d = device d's metadata); weights are
replicated. ``per_shard`` runs a single-device function on every device under
``jax.shard_map``: the body sees row d without its device axis, nothing moves
cache bytes between devices, and a donated cache stays in place.

One device is the N = 1 case of the same code: ``single_device_mesh()`` and a
cache of shape ``[1, total_words]``.

Host side (``glm5_jax.serving.engine``): one BlockPool per shard; ``put_per_shard``
places stacked per-device step metadata, ``host_shard`` reads one device's row
back without touching the others. ``cache_traffic`` reads a compiled step's HLO
text and lists what would break those promises: cross-device ops, copies of the
cache, a cache that is not updated in place.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import ops
from ..layout import CacheLayout

AXIS = "data"


# ---------------------------------------------------------------------------------
# meshes and the sharded cache
# ---------------------------------------------------------------------------------
def data_mesh(devices=None) -> Mesh:
    """A 1-D mesh over `devices` (default: all local devices) with axis ``data``."""
    devs = np.asarray(jax.devices() if devices is None else devices)
    if devs.size < 1:
        raise ValueError("data_mesh needs at least one device")
    return Mesh(devs.reshape(-1), (AXIS,))


def single_device_mesh() -> Mesh:
    """The default mesh: the first device alone (a one-shard cache)."""
    return data_mesh(jax.devices()[:1])


def check_mesh(mesh) -> int:
    """The number of cache shards of `mesh` (its ``data`` axis size).

    ValueError for anything but a Mesh with a ``data`` axis; other axes must have
    size 1 (a cache shard per device, no other parallelism).
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must have a {AXIS!r} axis (one cache shard per device along it); "
                         f"its axes are {tuple(mesh.axis_names)}")
    others = {a: n for a, n in mesh.shape.items() if a != AXIS and n != 1}
    if others:
        raise ValueError(f"only the {AXIS!r} axis may have more than one device; the mesh also has {others}")
    return int(mesh.shape[AXIS])


def shard_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the devices (row d on device d)."""
    return NamedSharding(mesh, P(AXIS))


def replicated(tree, mesh: Mesh):
    """Every leaf of `tree` copied whole to every device of the mesh (weights)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def allocate(layout: CacheLayout, mesh: Mesh, fill_byte: int = 0):
    """uint32[num_devices, total_words], row d on device d (every byte = fill_byte)."""
    n = check_mesh(mesh)
    if not 0 <= fill_byte <= 255:
        raise ValueError("fill_byte must be in [0, 255]")
    word = np.uint32(fill_byte * 0x01010101)
    return jax.jit(lambda: jnp.full((n, layout.total_words), word, jnp.uint32),
                   out_shardings=shard_sharding(mesh))()


def check_cache(cache, layout: CacheLayout, mesh: Mesh) -> None:
    """ValueError unless cache is uint32[mesh data size, layout.total_words]."""
    n = check_mesh(mesh)
    shape = tuple(getattr(cache, "shape", ()))
    if len(shape) != 2 or shape[1] != layout.total_words:
        raise ValueError(f"a sharded cache must have shape (num_devices, {layout.total_words}), got {shape}")
    if shape[0] != n:
        raise ValueError(f"the cache's leading axis ({shape[0]}) must equal the mesh's {AXIS!r} axis "
                         f"size ({n}): one row per device")
    if jnp.dtype(cache.dtype) != jnp.uint32:
        raise ValueError(f"a sharded cache must be uint32, got {cache.dtype}")


def put_per_shard(tree, mesh: Mesh):
    """Host arrays with a leading device axis -> device arrays, row d on device d."""
    n = check_mesh(mesh)
    for leaf in jax.tree.leaves(tree):
        if np.shape(leaf)[:1] != (n,):
            raise ValueError(f"per-device arrays need a leading axis of {n} (one row per device), "
                             f"got shape {np.shape(leaf)}")
    return jax.device_put(tree, shard_sharding(mesh))


def _row_of(cache, shard: int):
    """The addressable piece of `cache` holding device row `shard` ([1, words], on its device)."""
    for s in cache.addressable_shards:
        if (s.index[0].start or 0) == shard:
            return s.data
    raise ValueError(f"shard {shard} is not a row of this cache (leading axis {cache.shape[0]})")


def host_shard(cache, shard: int) -> np.ndarray:
    """A host copy of device row `shard`: uint32[total_words], read from that device only."""
    return np.asarray(_row_of(cache, shard)).reshape(-1)


def device_shard(cache, shard: int):
    """Device row `shard` as the array already on its device: uint32[1, total_words] (no copy)."""
    return _row_of(cache, shard)


def host_words(cache, shard: int, words) -> np.ndarray:
    """cache[shard, words] on the host (uint32[n]): only those words leave the device.
    ``words`` are global word addresses (numpy int64); the gather indexes the
    [rows, VIEW_COLS] view, so caches past 2**31 words work."""
    return np.asarray(device_words(cache, shard, words))


def device_words(cache, shard: int, words):
    """cache[shard, words] gathered on that shard's device (uint32[n], a device array):
    the gather is queued behind the work already queued there; nothing waits."""
    from pallas_kernels.core.addressing import view_row_col
    rows, cols = view_row_col(np.asarray(words, np.int64))
    row = _row_of(cache, shard)
    device = next(iter(row.devices()))
    rows, cols = jax.device_put((rows.astype(np.int32), cols.astype(np.int32)), device)
    return gather_view_words(row, rows, cols)


@jax.jit
def gather_view_words(cache, rows, cols):
    """cache (any shape, uint32) seen as [rows, VIEW_COLS] words, at (rows, cols): on
    the device, int32 indices for any cache size."""
    from pallas_kernels.core.strides import VIEW_COLS
    return cache.reshape(-1, VIEW_COLS)[rows, cols]


# ---------------------------------------------------------------------------------
# running single-device code on every shard
# ---------------------------------------------------------------------------------
def per_shard(fn, mesh: Mesh, *, replicated_args: int = 0):
    """fn run once per device under ``jax.shard_map``.

    Call the result with ``replicated_args`` leading arguments that every device
    sees whole (weights), then arguments whose every leaf has a leading device
    axis (cache [D, words], metadata [D, ...]). On device d, fn gets row d of
    those without the device axis; every leaf of fn's result gets the device
    axis back (out: [D, ...], row d from device d). No data moves between devices.
    """
    check_mesh(mesh)

    def body(*args):
        whole, rows = args[:replicated_args], args[replicated_args:]
        out = fn(*whole, *jax.tree.map(lambda a: a[0], rows))
        return jax.tree.map(lambda o: o[None], out)

    def call(*args):
        specs = (P(),) * replicated_args + (P(AXIS),) * (len(args) - replicated_args)
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(AXIS), check_vma=False)(*args)

    return call


def _op_per_shard(op, cache, mesh, layout, layer, kw, **arrays):
    """ops.<op>(cache row, layout, layer, **arrays rows, **kw) on every device."""
    check_cache(cache, layout, mesh)
    names = list(arrays)
    f = functools.partial(op, layout=layout, layer=layer, **kw)
    return per_shard(lambda c, *xs: f(c, **dict(zip(names, xs))), mesh)(cache, *arrays.values())


def seed_tail(cache, mesh: Mesh, layout: CacheLayout, layer: int, key, gate, tslot, **kw):
    """ops.seed_tail per shard: cache [D, words]; key, gate [D, T, 128]; tslot [D, T]."""
    return _op_per_shard(ops.seed_tail, cache, mesh, layout, layer, kw, key=key, gate=gate, tslot=tslot)


def compress_prefill(cache, mesh: Mesh, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, **kw):
    """ops.compress_prefill per shard: ape [D, R, 128] (the same layer weights on every shard)."""
    return _op_per_shard(ops.compress_prefill, cache, mesh, layout, layer, kw, key=key, gate=gate, ape=ape,
                         slot_mapping=slot_mapping)


def decode_update(cache, mesh: Mesh, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, tslot,
                  positions, **kw):
    """ops.decode_update per shard: [D, B, n, ...] arguments."""
    return _op_per_shard(ops.decode_update, cache, mesh, layout, layer, kw, key=key, gate=gate, ape=ape,
                         slot_mapping=slot_mapping, tslot=tslot, positions=positions)


def select_tokens(cache, mesh: Mesh, layout: CacheLayout, layer: int, q8, weights, page_table_pages,
                  positions, **kw):
    """ops.select_tokens per shard (the read path): q8 [D, B, n, H, 128], weights [D, B, n, H],
    page_table_pages [D, B, max_pages], positions [D, B, n] -> [D, B * n, topk + kpool - 1] i32."""
    return _op_per_shard(ops.select_tokens, cache, mesh, layout, layer, kw, q8=q8, weights=weights,
                         page_table_pages=page_table_pages, positions=positions)


# ---------------------------------------------------------------------------------
# what a compiled step does with the cache
# ---------------------------------------------------------------------------------
_CROSS_DEVICE = re.compile(r"\s(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter|"
                           r"collective-broadcast|send|recv)(-start|-done)?\(")


def cache_traffic(hlo_text: str, layout: CacheLayout) -> dict:
    """Read the text of a compiled program (``Compiled.as_text()``) that takes a cache
    row of `layout`: ``cross_device`` lists its collective / send / recv
    instructions (of anything), ``cache_copies`` its copies of an array the size
    of the cache (1-D, per-device row or kernel view), ``cache_aliased`` says
    whether output 0 is the per-device cache parameter updated in place (donated).
    A step that keeps every shard on its device and the cache in place has no
    cross-device op, no cache copy, and the alias."""
    w = layout.total_words
    shapes = {f"{w}", f"1,{w}", f"{w // 1024},1024", f"1,{w // 1024},1024"}
    copies = [ln.strip() for ln in hlo_text.splitlines()
              if (m := re.search(r"= u32\[([\d,]*)\]\S* copy(-start)?\(", ln)) and m.group(1) in shapes]
    alias = re.search(r"input_output_alias=\{ \{0?\}: \((\d+),", hlo_text)     # output 0 (or the only one)
    entry = hlo_text[hlo_text.find("\nENTRY"):]
    aliased = bool(alias) and bool(re.search(rf"= u32\[1,{w}\]\S* parameter\({alias.group(1)}\)", entry))
    return dict(cross_device=[ln.strip() for ln in hlo_text.splitlines() if _CROSS_DEVICE.search(ln)],
                cache_copies=copies, cache_aliased=aliased)


def host_waits(hlo_text: str) -> list:
    """Instructions of a compiled program (``Compiled.as_text()``) at which XLA's GPU
    runtime waits for the device before it can go on dispatching: every ``while``
    without a known trip count (its condition is copied to the host on each
    iteration). Measured on the H200 with jax 0.11.2 (docs/benchmarks.md, "XLA chains
    unrolled 8"): such a loop holds the call until the device is done; a ``conditional`` and a
    loop with a static trip count do not (the host launches the latter's body once
    per iteration, which costs time but does not wait)."""
    return [ln.strip()[:200] for ln in hlo_text.splitlines()
            if re.search(r"\swhile\(", ln) and "known_trip_count" not in ln]
