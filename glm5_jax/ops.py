"""Public ops of the kpool indexer cache.

One function per op. Every writer returns the new cache; thread it through and
``jax.jit(..., donate_argnums=0)`` so the update happens in place. ``layout`` and
``layer`` are static.

``implementation``:
  * ``"xla"``    the golden reference (``glm5_jax.reference``), any backend;
  * ``"pallas"`` the Pallas kernels (compiled on GPU, interpret mode on CPU);
  * ``None``     the fastest available correct implementation: Pallas on GPU,
                 XLA elsewhere (interpret mode is for testing, not speed).
Both implementations write identical bytes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import reference as ref
from .layout import CacheLayout

IMPLEMENTATIONS = ("xla", "pallas")


def default_implementation() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def _impl(op: str, implementation):
    impl = default_implementation() if implementation is None else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS} or None, got {impl!r}")
    return impl


def _check(op, name, x, shape, dtypes):
    """Shape/dtype check at the boundary (works on tracers: shapes are static)."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        raise ValueError(f"{op}: {name} must be {'/'.join(str(jnp.dtype(d)) for d in dtypes)}, got {x.dtype}")


_INT = (jnp.int32,)
_BF16 = (jnp.bfloat16,)


def _check_cache(op, cache, layout: CacheLayout):
    if not isinstance(layout, CacheLayout):
        raise ValueError(f"{op}: layout must be a CacheLayout, got {type(layout).__name__}")
    _check(op, "cache", cache, (layout.total_words,), (jnp.uint32,))


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_pool_slots(op, slot_mapping, layout, flat_rows: bool):
    """Concrete inputs only: no valid pool slot twice; a flat batch completes <= T // kpool pools."""
    if not _concrete(slot_mapping):
        return
    import numpy as np
    sm = np.asarray(slot_mapping).ravel()
    c = layout.config
    limit = layout.num_blocks * c.pools_per_block
    valid = (sm >= 0) & (sm < limit)
    if flat_rows:
        valid[: c.kpool - 1] = False
        if valid.sum() > sm.size // c.kpool:
            raise ValueError(f"{op}: slot_mapping completes {int(valid.sum())} pools in {sm.size} rows; "
                             f"at most {sm.size // c.kpool} are possible (each pool owns kpool rows)")
    v = sm[valid]
    if np.unique(v).size != v.size:
        raise ValueError(f"{op}: slot_mapping writes the same pool slot twice in one batch")


def _strides(layout, layer, fault):
    return layout.strides(layer, fault=fault)


def seed_tail(cache, layout: CacheLayout, layer: int, key, gate, tslot, *,
              implementation=None, interpret=None, fault=None):
    """Seed each request's tail ring with its last kpool tokens of the batch (spec 5.3).

    key, gate: [T, 128] bf16; tslot: [T] int32 token-granular tail slots (-1 = padding).
    """
    op = "seed_tail"
    _check_cache(op, cache, layout)
    t = key.shape[0]
    _check(op, "key", key, (t, 128), _BF16)
    _check(op, "gate", gate, (t, 128), _BF16)
    _check(op, "tslot", tslot, (t,), _INT)
    s = _strides(layout, layer, fault)
    if _impl(op, implementation) == "xla":
        return ref.seed_tail_strides(cache, s, key, gate, tslot)
    from pallas_kernels.tail_seed import seed_tail as kernel
    return kernel(cache, s, key, gate, tslot, interpret=interpret)


def compress_prefill(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, *,
                     implementation=None, interpret=None, fault=None):
    """Compress every pool completed in a prefill slice and write it (spec 5.2).

    key, gate: [T, 128] bf16; ape: [kpool, 128] f32; slot_mapping: [T] int32 pool slots.
    """
    op = "compress_prefill"
    _check_cache(op, cache, layout)
    t = key.shape[0]
    r = layout.config.kpool
    _check(op, "key", key, (t, 128), _BF16)
    _check(op, "gate", gate, (t, 128), _BF16)
    _check(op, "ape", ape, (r, 128), (jnp.float32,))
    _check(op, "slot_mapping", slot_mapping, (t,), _INT)
    _check_pool_slots(op, slot_mapping, layout, flat_rows=True)
    s = _strides(layout, layer, fault)
    if _impl(op, implementation) == "xla":
        return ref.compress_prefill_strides(cache, s, key, gate, ape, slot_mapping)
    from pallas_kernels.pool_compress import compress_prefill as kernel
    return kernel(cache, s, key, gate, ape, slot_mapping, interpret=interpret)


def decode_update(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, tslot,
                  positions, *, implementation=None, interpret=None, fault=None):
    """Batched decode: stash each token in its ring, completing pools on the way (spec 5.4).

    key, gate: [B, n, 128] bf16; ape [kpool, 128] f32; slot_mapping, tslot, positions: [B, n] int32.
    Padding: position -1. Tokens of a request are taken in index order (= position order).
    """
    op = "decode_update"
    _check_cache(op, cache, layout)
    b, n = positions.shape
    r = layout.config.kpool
    _check(op, "key", key, (b, n, 128), _BF16)
    _check(op, "gate", gate, (b, n, 128), _BF16)
    _check(op, "ape", ape, (r, 128), (jnp.float32,))
    for name, x in (("slot_mapping", slot_mapping), ("tslot", tslot), ("positions", positions)):
        _check(op, name, x, (b, n), _INT)
    _check_pool_slots(op, slot_mapping, layout, flat_rows=False)
    s = _strides(layout, layer, fault)
    if _impl(op, implementation) == "xla":
        return ref.decode_update_strides(cache, s, key, gate, ape, slot_mapping, tslot, positions)
    from pallas_kernels.decode_update import decode_update as kernel
    return kernel(cache, s, key, gate, ape, slot_mapping, tslot, positions, interpret=interpret)


def fwht_quant(q, *, implementation=None, interpret=None):
    """q: [rows, 128] bf16 -> (q8 [rows, 128] float8_e4m3fn, scale [rows] f32) (spec 2.3)."""
    op = "fwht_quant"
    if q.ndim != 2 or q.shape[1] != 128:
        raise ValueError(f"{op}: q must be [rows, 128], got {tuple(q.shape)}")
    _check(op, "q", q, q.shape, _BF16)
    if _impl(op, implementation) == "xla":
        return ref.fwht_quant(q)
    raise NotImplementedError(f"{op}: the Pallas kernel arrives with the read-path issue; "
                              f"use implementation='xla'")
