"""Public ops of the kpool indexer cache.

One function per op. Every writer returns the new cache; thread it through and
``jax.jit(..., donate_argnums=0)`` so the update happens in place. ``layout`` and
``layer`` are static.

``implementation``:
  * ``"xla"``    the golden reference (``glm5_jax.reference``), any backend;
  * ``"pallas"`` the Pallas kernels (compiled on GPU, interpret mode on CPU);
  * ``"triton"`` kernels in the Triton language called through ``jax_triton``
                 (``pallas_kernels.triton_lang``): the write ops, and the read
                 path on Hopper's tensor cores (paged_logits, topk_pools,
                 select_tokens). GPU only, and only with the ``triton`` extra
                 installed; elsewhere it raises ``TritonUnavailableError`` saying
                 why and naming "pallas" / "xla" (no CPU/interpret mode);
  * ``None``     the first AVAILABLE entry of ``DEFAULT_ORDER`` for the op and
                 the backend: on GPU pallas -> triton -> xla for the writers,
                 pallas -> xla for the read ops, and for select_tokens the
                 Triton tensor-core path when a request brings at least
                 TC_MIN_ROWS query rows (prefill chunks), the Pallas path for
                 decode rows, whatever the batch size, and for topk_pools the
                 Triton top-k for the shapes of ``tc_topk_by_default``; XLA elsewhere
                 (interpret mode is for testing, not speed).
                 "pallas" counts as available on a GPU backend, "triton" when
                 jax_triton also imports.
All implementations write identical cache bytes. The read ops' logits differ
between implementations only by f32 rounding (docs/design.md, the accuracy
contract); top-k and expansion are exact on the logits they are given.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.core import addressing as addr
from pallas_kernels.read import expand as _expand
from pallas_kernels.read import paged_logits as _paged_logits
from pallas_kernels.read import paged_topk as _paged_topk
from pallas_kernels.read import query_quant as _query_quant
from pallas_kernels.read import workspace as _workspace
from pallas_kernels.topk import topk_pools as _topk_kernel
from pallas_kernels.triton_lang import _call as _triton
from pallas_kernels.writes import decode_update as _decode_update
from pallas_kernels.writes import pool_compress as _pool_compress
from pallas_kernels.writes import tail_seed as _tail_seed

from . import reference as ref
from .layout import CacheLayout

IMPLEMENTATIONS = ("xla", "pallas", "triton")
TRITON_OPS = ("seed_tail", "compress_prefill", "decode_update", "paged_logits", "topk_pools", "select_tokens")
TritonUnavailableError = _triton.TritonUnavailableError

# implementation=None: the first available implementation of this list, per backend
# (jax.default_backend()) and op; "*" rows are the defaults. ONE table, to be edited
# from the GPU measurements (benchmarks/bench_writes.py --impls pallas,triton,xla).
# The "*" op row of a backend is also what default_implementation() gives callers
# that pick one implementation for every op (the engine, the CLI).
DEFAULT_ORDER = {
    "gpu": {
        "seed_tail":        ("pallas", "triton", "xla"),
        "compress_prefill": ("pallas", "triton", "xla"),
        "decode_update":    ("pallas", "triton", "xla"),
        "*":                ("pallas", "xla"),
    },
    "*": {"*": ("xla",)},
}


def _available(impl: str, op: str | None, backend: str) -> bool:
    """Whether implementation=None may pick `impl` for `op` on `backend`."""
    if impl == "xla":
        return True
    if impl == "pallas":
        return backend == "gpu"                       # interpret mode is for tests, not a default
    if impl == "triton":
        return backend == "gpu" and op in TRITON_OPS and _triton.available()
    return False


def default_implementation(op: str | None = None) -> str:
    """What ``implementation=None`` runs for `op` on this backend (see DEFAULT_ORDER).

    With op=None: one implementation that every op accepts (the backend's "*" row),
    for callers that choose once for a whole model.
    """
    backend = jax.default_backend()
    table = DEFAULT_ORDER.get(backend, DEFAULT_ORDER["*"])
    order = table.get(op, table["*"]) if op is not None else table["*"]
    for impl in order:
        if _available(impl, op, backend):
            return impl
    return "xla"


def _impl(op: str, implementation):
    if implementation is None:
        return default_implementation(op)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation == "triton":
        if op not in TRITON_OPS:
            raise ValueError(f"{op}: implementation='triton' exists only for the ops {TRITON_OPS}; "
                             f"use 'pallas' or 'xla'")
        _triton.require(op)
    return implementation


def _write_impl(op: str, implementation, interpret):
    """_impl for the writers, which also reject interpret mode for Triton (jax_triton has none)."""
    if implementation == "triton" and interpret:
        raise ValueError(f"{op}: implementation='triton' has no interpret mode (jax_triton compiles for "
                         f"GPUs only); use implementation='pallas' with interpret=True on CPU")
    return _impl(op, implementation)


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


def _check_pool_slots(op, slot_mapping, layout, flat_rows: bool, positions=None):
    """Concrete inputs only: no valid pool slot twice; a flat batch completes <= T // kpool pools.

    Decode tokens with position < 0 are padding and never write, whatever their slot.
    """
    if not _concrete(slot_mapping, positions):
        return
    sm = np.asarray(slot_mapping).ravel()
    c = layout.config
    valid = addr.pool_slot_valid(layout.strides(0), sm)      # every layer has the same pool slots
    if positions is not None:
        valid &= np.asarray(positions).ravel() >= 0
    if flat_rows:
        valid[: c.kpool - 1] = False
        if valid.sum() > sm.size // c.kpool:
            raise ValueError(f"{op}: slot_mapping completes {int(valid.sum())} pools in {sm.size} rows; "
                             f"at most {sm.size // c.kpool} are possible (each pool owns kpool rows)")
        rows = np.nonzero(valid)[0]
        close = np.nonzero(np.diff(rows) < c.kpool)[0]
        if close.size:
            i = int(close[0])
            raise ValueError(f"{op}: slot_mapping completes pools at rows {rows[i]} and {rows[i + 1]}, "
                             f"closer than kpool = {c.kpool} (each pool owns its kpool rows)")
    v = sm[valid]
    if np.unique(v).size != v.size:
        raise ValueError(f"{op}: slot_mapping writes the same pool slot twice in one batch")


def _at(shape, flat_index) -> str:
    """'[i]' / '[b, j]': the index of the flat_index-th entry of an array of `shape`."""
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(int(flat_index), shape)) + "]"


def _refuse_null_block(op, name, slots, layout, unit: str, positions=None):
    """Concrete inputs only: no slot in the null block 0. Block 0 is what padded page
    tables point at, so it is never written: under jit ``addressing.pool_slot_valid`` /
    ``tail_slot_valid`` ignore such slots like padding; a concrete one is a bug of the
    caller's metadata (``glm5_jax.metadata`` never builds one). unit: "pool" or "tail".
    Decode tokens with position < 0 are padding and never write, whatever their slots."""
    if not _concrete(slots, positions):
        return
    a = np.asarray(slots)
    per_block = layout.config.pools_per_block if unit == "pool" else layout.config.ring
    bad = (a >= 0) & (a < per_block)
    if positions is not None:
        bad &= np.asarray(positions) >= 0
    if bad.any():
        i = int(np.argmax(bad.ravel()))
        raise ValueError(f"{op}: {name}{_at(a.shape, i)} = {int(a.ravel()[i])} is a {unit} slot of the null "
                         f"block 0 ({unit} slots 0 .. {per_block - 1}); block 0 is never written "
                         f"(padding is -1)")


def _refuse_completions_without_tail(op, slot_mapping, tslot, positions, layout):
    """Concrete inputs only: a decode token that completes a pool has a valid tail slot.
    The pool's earlier members are read from that tail block's ring, so a token with
    an invalid one (-1, block 0, past the last block) writes nothing under jit
    (``addressing.decode_completes``), not a pool pooled from another block's ring."""
    if not _concrete(slot_mapping, tslot, positions):
        return
    s = layout.strides(0)                                    # every layer has the same slots
    pos, loc, ts = (np.asarray(x) for x in (positions, slot_mapping, tslot))
    orphan = ((pos >= 0) & (pos % s.kpool == s.kpool - 1) & addr.pool_slot_valid(s, loc)
              & ~addr.tail_slot_valid(s, ts))
    if orphan.any():
        i = int(np.argmax(orphan.ravel()))
        raise ValueError(f"{op}: token {_at(pos.shape, i)} completes pool slot {int(loc.ravel()[i])} but its "
                         f"tail slot {int(ts.ravel()[i])} is invalid (valid: {s.ring} .. "
                         f"{s.num_tail_slots - 1}); the pool's other members are in its own tail ring, "
                         f"so such a token writes nothing")


def _check_decode_owners(op, slot_mapping, tslot, positions, layout):
    """Concrete inputs only: the one-owner rule of block ids (docs/semantics.md 3.5) within a call.
    Requests run in parallel, one program each, so a tail block used by the live tokens
    of two rows b would be written by both; and a pool record inside a tail block of the
    call would overlap ring rows the launch reads (the "forward" program takes ring rows
    as the launch found them). Both are refused: which bytes win is left to the GPU."""
    if not _concrete(slot_mapping, tslot, positions):
        return
    s = layout.strides(0)
    pos, loc, ts = (np.asarray(x).astype(np.int64) for x in (positions, slot_mapping, tslot))
    rows = np.broadcast_to(np.arange(pos.shape[0])[:, None], pos.shape)
    stash = addr.decode_stashes(s, pos, ts)
    blk, row = addr.tail_block(s, ts)[stash], rows[stash]
    pairs = np.unique(np.stack([blk, row], axis=1), axis=0)
    shared = np.nonzero(np.diff(pairs[:, 0]) == 0)[0]
    if shared.size:
        b, r0, r1 = (int(v) for v in (pairs[shared[0], 0], pairs[shared[0], 1], pairs[shared[0] + 1, 1]))
        raise ValueError(f"{op}: tail block {b} is used by rows {r0} and {r1}; a tail block belongs to one "
                         f"request of the batch")
    complete = addr.decode_completes(s, pos, loc, ts)
    in_tail = complete & np.isin(loc // s.pools_per_block, blk)
    if in_tail.any():
        i = int(np.argmax(in_tail.ravel()))
        raise ValueError(f"{op}: token {_at(pos.shape, i)} writes pool slot {int(loc.ravel()[i])} in block "
                         f"{int(loc.ravel()[i]) // s.pools_per_block}, a tail block of this call; a block holds "
                         f"pools or a tail ring, not both")


def _check_seed_rows(op, tslot, request_ends_tokens, layout):
    """Concrete inputs only: the rows seed_tail writes are well defined, and
    request_ends_tokens (when given) agrees with the tail slots.

    The seeded rows (``reference.seed_tail_strides``' rule: a valid tail slot, and the
    row kpool ahead absent, padding or in another tail block) must not write one tail
    slot twice: which row would win is left to the backend. An entry of
    request_ends_tokens is 0 (padding) or one past a request's last row (a row with a
    valid tail slot whose next row is absent, padding or in another tail block), and
    every seeded row lies in the last kpool rows before an entry. Under jit a row is
    seeded only inside those windows, in every implementation (``reference.end_windows``).
    """
    if not _concrete(tslot, request_ends_tokens):
        return
    s = layout.strides(0)                                    # every layer has the same tail slots
    ts = np.asarray(tslot).astype(np.int64)
    t, r = ts.size, s.kpool
    valid = addr.tail_slot_valid(s, ts)
    blk = addr.tail_block(s, ts)
    ahead = np.concatenate([ts[r:], np.full(min(r, t), -1)])
    seeded = valid & ((ahead < 0) | (addr.tail_block(s, ahead) != blk))
    rows = np.nonzero(seeded)[0]
    order = np.argsort(ts[rows], kind="stable")
    same = np.nonzero(np.diff(ts[rows][order]) == 0)[0]
    if same.size:
        i, j = sorted(rows[order][same[0]:same[0] + 2])
        raise ValueError(f"{op}: rows {i} and {j} both seed tail slot {int(ts[i])} (each is among its request's "
                         f"last kpool = {r} rows); a ring row is written once per call")
    if request_ends_tokens is None:
        return
    e = np.asarray(request_ends_tokens).astype(np.int64)
    if (e < 0).any():
        k = int(np.argmax(e < 0))
        raise ValueError(f"{op}: request_ends_tokens[{k}] = {int(e[k])} is negative; entries are one past a "
                         f"request's last row, or 0 for padding")
    nxt_valid = np.concatenate([valid[1:], [False]])
    nxt_blk = np.concatenate([blk[1:], [-1]])
    last = valid & (~nxt_valid | (nxt_blk != blk))           # the last row of its request
    for k, end in enumerate(e):
        if end > 0 and not last[end - 1]:
            why = ("has no valid tail slot" if not valid[end - 1] else
                   f"is followed by row {end} of the same tail block {int(blk[end - 1])}")
            raise ValueError(f"{op}: request_ends_tokens[{k}] = {int(end)} ends no request: row {int(end) - 1} {why}")
    covered = np.zeros(t, bool)
    for end in e[e > 0]:
        covered[max(int(end) - r, 0):int(end)] = True
    missing = seeded & ~covered
    if missing.any():
        i = int(np.argmax(missing))
        raise ValueError(f"{op}: request_ends_tokens has no entry for the request of row {i} (tail block "
                         f"{int(blk[i])}), which seed_tail writes; every request needs one past its last row")


def seed_tail(cache, layout: CacheLayout, layer: int, key, gate, tslot, *, request_ends_tokens=None,
              implementation=None, interpret=None):
    """Seed each request's tail ring with its last kpool tokens of the batch (docs/semantics.md 5.3).

    key, gate: [T, 128] bf16; tslot: [T] int32 token-granular tail slots (-1 = padding).
    request_ends_tokens: optional [N] int32, one past the last row of each request in the
    batch (vLLM's query_start_loc[1:]; 0 marks a padding entry). It lets the kernel
    visit only each request's last kpool rows, so the cost no longer grows with the
    prompt length; entries that agree with the tail slots change no byte written.
    Each request's rows must be contiguous and end at its entry. Under jit every
    implementation seeds only rows inside the windows [e - kpool, e) of the entries
    e > 0; on concrete input disagreeing entries are refused (docs/design.md, "Input
    contract of the ops").
    """
    op = "seed_tail"
    _check_cache(op, cache, layout)
    t = key.shape[0]
    _check(op, "key", key, (t, 128), _BF16)
    _check(op, "gate", gate, (t, 128), _BF16)
    _check(op, "tslot", tslot, (t,), _INT)
    if request_ends_tokens is not None:
        _check(op, "request_ends_tokens", request_ends_tokens, (request_ends_tokens.shape[0],), _INT)
        if _concrete(request_ends_tokens):
            e = np.asarray(request_ends_tokens)
            if (e > t).any():
                raise ValueError(f"{op}: request_ends_tokens must be <= the batch's {t} rows, got max {e.max()}")
    _refuse_null_block(op, "tslot", tslot, layout, "tail")
    _check_seed_rows(op, tslot, request_ends_tokens, layout)
    s = layout.strides(layer)
    impl = _write_impl(op, implementation, interpret)
    return DISPATCH[op, impl](cache, s, key, gate, tslot, request_ends_tokens, interpret=interpret)


def compress_prefill(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, *,
                     implementation=None, interpret=None):
    """Compress every pool completed in a prefill slice and write it (docs/semantics.md 5.2).

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
    _refuse_null_block(op, "slot_mapping", slot_mapping, layout, "pool")
    _check_pool_slots(op, slot_mapping, layout, flat_rows=True)
    s = layout.strides(layer)
    impl = _write_impl(op, implementation, interpret)
    return DISPATCH[op, impl](cache, s, key, gate, ape, slot_mapping, interpret=interpret)


def decode_update(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, tslot,
                  positions, *, implementation=None, interpret=None):
    """Batched decode: stash each token in its ring, completing pools on the way (docs/semantics.md 5.4).

    key, gate: [B, n, 128] bf16; ape [kpool, 128] f32; slot_mapping, tslot, positions: [B, n] int32.
    Padding: position -1. Tokens of a request are taken in index order (= position order).
    """
    op = "decode_update"
    _check_cache(op, cache, layout)
    if positions.ndim != 2:
        raise ValueError(f"{op}: positions must be [B, n] int32, got shape {tuple(positions.shape)}")
    b, n = positions.shape
    r = layout.config.kpool
    _check(op, "key", key, (b, n, 128), _BF16)
    _check(op, "gate", gate, (b, n, 128), _BF16)
    _check(op, "ape", ape, (r, 128), (jnp.float32,))
    for name, x in (("slot_mapping", slot_mapping), ("tslot", tslot), ("positions", positions)):
        _check(op, name, x, (b, n), _INT)
    _refuse_null_block(op, "slot_mapping", slot_mapping, layout, "pool", positions)
    _refuse_null_block(op, "tslot", tslot, layout, "tail", positions)
    _refuse_completions_without_tail(op, slot_mapping, tslot, positions, layout)
    _check_decode_owners(op, slot_mapping, tslot, positions, layout)
    _check_pool_slots(op, slot_mapping, layout, flat_rows=False, positions=positions)
    s = layout.strides(layer)
    impl = _write_impl(op, implementation, interpret)
    return DISPATCH[op, impl](cache, s, key, gate, ape, slot_mapping, tslot, positions, interpret=interpret)


def fwht_quant(q, *, implementation=None, interpret=None):
    """q: [rows, 128] bf16 -> (q8 [rows, 128] float8_e4m3fn, scale [rows] f32) (docs/semantics.md 2.3)."""
    op = "fwht_quant"
    if q.ndim != 2 or q.shape[1] != 128:
        raise ValueError(f"{op}: q must be [rows, 128], got {tuple(q.shape)}")
    _check(op, "q", q, q.shape, _BF16)
    return DISPATCH[op, _impl(op, implementation)](q, interpret=interpret)


# =================================================================================
# Read path (docs/semantics.md 1.3, 2.3-2.5, 5.5-5.10): query preparation, paged logits, exact
# top-k over pools, expansion to tokens, and the whole token selection.
# =================================================================================
_F32 = (jnp.float32,)
_FP8 = (jnp.float8_e4m3fn,)
READ_PATHS = ("fused", "unfused")
FUSED_MIN_ROWS = 64     # query rows per request from which select_tokens' default path is "fused"


def default_read_path(rows_per_request: int) -> str:
    """select_tokens' path when none is given: "unfused" for decode-sized row counts,
    "fused" from FUSED_MIN_ROWS rows per request (prefill chunks). Measured on the
    H200 (docs/benchmarks.md): decode B = 64 x 128k, 1 row, unfused 160-163 us against
    fused 423-428. Prefill of one request: 32k tokens fused 20.0 ms, unfused 23.8;
    128k tokens fused 194.3 ms, unfused 162.0. So at 128k the unfused path is faster, but it
    writes every chunk's logits to memory (512 MiB at a time) and reads them back;
    the fused path never writes logits, which is what a long prefill is asked to
    do, so prefill stays fused. Pass path="unfused" to trade that memory traffic
    for speed at long contexts. Between 1 and 32k rows the crossover is not
    measured; 64 keeps decode and speculative decode (next_n <= 8) unfused."""
    return "fused" if rows_per_request >= FUSED_MIN_ROWS else "unfused"


def padded_heads(n_heads: int) -> int:
    """Heads the logits run with: 32 for n_heads <= 32, else 64 (1 <= n_heads <= 64)."""
    return ref.padded_heads(n_heads)


def fold_weights(weights, q_scale):
    """w' = w * qs * 128**-0.5 * H**-0.5 (real H), zero-padded to padded_heads(H) (docs/semantics.md 2.3).

    weights, q_scale: [..., H] f32 -> [..., Hp] f32.
    """
    op = "fold_weights"
    _check(op, "weights", weights, weights.shape, _F32)
    _check(op, "q_scale", q_scale, weights.shape, _F32)
    return ref.fold_weights(weights, q_scale)


def pad_heads(q8):
    """[..., H, 128] float8_e4m3fn -> [..., padded_heads(H), 128] (zero heads appended)."""
    if q8.ndim < 2 or q8.shape[-1] != 128:
        raise ValueError(f"pad_heads: q8 must be [..., H, 128], got {tuple(q8.shape)}")
    _check("pad_heads", "q8", q8, q8.shape, _FP8)
    return ref.pad_heads(q8)


def prepare_queries(q, weights, *, implementation=None, interpret=None):
    """Query side of one indexer layer (docs/semantics.md 2.3, 5.1).

    q: [..., H, 128] bf16; weights: [..., H] f32 (per-head weights, computed in f32).
    Returns (q8 [..., Hp, 128] float8_e4m3fn, w' [..., Hp] f32): every (token, head)
    row rotated and quantised (``fwht_quant``), the query scale and
    128**-0.5 * H**-0.5 folded into the weights, heads zero-padded to 32 or 64.
    """
    op = "prepare_queries"
    if q.ndim < 2 or q.shape[-1] != 128:
        raise ValueError(f"{op}: q must be [..., H, 128], got {tuple(q.shape)}")
    _check(op, "q", q, q.shape, _BF16)
    _check(op, "weights", weights, q.shape[:-1], _F32)
    lead, h = q.shape[:-2], q.shape[-2]
    padded_heads(h)
    q8, qs = fwht_quant(q.reshape(-1, 128), implementation=implementation, interpret=interpret)
    q8 = q8.reshape(lead + (h, 128))
    return ref.pad_heads(q8), ref.fold_weights(weights, qs.reshape(lead + (h,)))


def _pallas_read_ok(s, hp) -> bool:
    try:
        _paged_logits.check_geometry(s, hp)
        return True
    except ValueError:
        return False


def _tc_read_ok(s, hp) -> bool:
    try:
        _workspace.check_tc_geometry(s.page_rows, hp, addr.key_rows_16b_aligned(s))
        return True
    except ValueError:
        return False


# implementation=None on a GPU: select_tokens runs the Triton tensor-core path for
# requests of at least this many query rows (prefill chunks), where it is 3.4x
# faster than the Pallas path at 32k tokens (docs/benchmarks.md). The choice reads
# the width of the query grid (rows per request) and nothing else: never the batch
# size or the page tables' width. A caller whose grid width varies for the same rows
# (the engine's prefill buckets) names one implementation for all of them
# (default_select_implementation; docs/design.md, the accuracy contract).
TC_MIN_ROWS = 64


def tc_select_by_default(rows_per_request: int) -> bool:
    """Whether select_tokens with implementation=None takes the Triton tensor-core path
    on a GPU that has it, for a call of `rows_per_request` query rows per request:
    prefill chunks of TC_MIN_ROWS rows or more. Decode rows keep the Pallas kernels,
    faster in most decode batches (docs/benchmarks.md); a batch-dependent choice would
    break batch invariance."""
    return rows_per_request >= TC_MIN_ROWS


def default_select_implementation(layout: CacheLayout, layer: int, n_heads: int, rows_per_request: int) -> str:
    """The implementation ``select_tokens(implementation=None)`` runs on this backend
    for a layer's query rows of `n_heads` heads, `rows_per_request` per request.

    A caller whose prefill rows come in grids of varying width (the engine's buckets,
    down to a few columns) names ``default_select_implementation(..., TC_MIN_ROWS)`` for
    all of them, so a prompt's rows take one implementation however they are chunked
    and batched."""
    if not isinstance(rows_per_request, int) or isinstance(rows_per_request, bool) or rows_per_request < 1:
        raise ValueError(f"rows_per_request must be a positive int, got {rows_per_request!r}")
    return _read_impl("select_tokens", None, layout.strides(layer), padded_heads(n_heads), rows_per_request)


# implementation=None on a GPU: topk_pools runs the Triton top-k inside the measured
# range (k from TC_TOPK_KS[0] to TC_TOPK_KS[1], rows of TC_TOPK_POOLS[0] to
# TC_TOPK_POOLS[1] pools; docs/benchmarks.md) where it was faster than the Pallas
# kernels: k = TC_TOPK_KS[1] over TC_TOPK_MIN_ROWS rows or more (the Pallas select
# slows sharply with k), and any k in the range over TC_TOPK_MANY_ROWS rows or more
# of at most TC_TOPK_SHORT_POOLS pools. Outside the range the Pallas kernels stay.
# Every implementation returns the same ids, so the choice changes only the time.
TC_TOPK_KS = (512, 2048)
TC_TOPK_POOLS = (8192, 262144)
TC_TOPK_MIN_ROWS = 64
TC_TOPK_MANY_ROWS = 256
TC_TOPK_SHORT_POOLS = 32768


def tc_topk_by_default(rows: int, n_pools: int, k: int) -> bool:
    """Whether topk_pools with implementation=None takes the Triton top-k on a GPU that
    has it, for [rows, n_pools] scores and top-k size k."""
    if not (TC_TOPK_KS[0] <= k <= TC_TOPK_KS[1] and TC_TOPK_POOLS[0] <= n_pools <= TC_TOPK_POOLS[1]):
        return False
    return ((k == TC_TOPK_KS[1] and rows >= TC_TOPK_MIN_ROWS)
            or (rows >= TC_TOPK_MANY_ROWS and n_pools <= TC_TOPK_SHORT_POOLS))


def _read_impl(op, implementation, s, hp, rows_per_request=None):
    """Like _impl, but None falls back to XLA where the kernels' tiles do not fit
    (page_rows not in {16, 32, 64}); an explicit "pallas" or "triton" raises there
    instead. For select_tokens, None picks "triton" where ``tc_select_by_default``
    says so for ``rows_per_request``; None there keeps the Pallas kernels."""
    if (implementation is None and op == "select_tokens" and rows_per_request is not None
            and tc_select_by_default(rows_per_request)
            and jax.default_backend() == "gpu" and _triton.available() and _tc_read_ok(s, hp)):
        return "triton"
    impl = _impl(op, implementation)
    if impl == "triton":
        try:
            _workspace.check_tc_geometry(s.page_rows, hp, addr.key_rows_16b_aligned(s))
        except ValueError as e:
            raise ValueError(f"{op}: {e}") from None
        return impl
    if impl == "pallas" and implementation is None and not _pallas_read_ok(s, hp):
        return "xla"
    if impl == "pallas":
        try:
            _paged_logits.check_geometry(s, hp)
        except ValueError as e:
            raise ValueError(f"{op}: {e}") from None
    return impl


def _check_queries(op, q8, weights):
    """Shapes/dtypes of q8 [B, n, H, 128] and weights [B, n, H]; returns them with the
    heads zero-padded to 32 or 64 (a no-op for 32 and 64; zero heads add exactly 0)."""
    if q8.ndim != 4 or q8.shape[-1] != 128:
        raise ValueError(f"{op}: q8 must be [B, n, H, 128], got {tuple(q8.shape)}")
    b, n, h, _ = q8.shape
    if not 1 <= h <= ref.MAX_HEADS:
        raise ValueError(f"{op}: q8 must have 1 .. {ref.MAX_HEADS} heads, got {h}")
    _check(op, "q8", q8, q8.shape, _FP8)
    _check(op, "weights", weights, (b, n, h), _F32)
    hp = padded_heads(h)
    if hp != h:
        q8 = ref.pad_heads(q8)
        weights = jnp.pad(weights, ((0, 0), (0, 0), (0, hp - h)))
    return q8, weights


def _check_page_table(op, page_table_pages, context_pools, layout: CacheLayout, s):
    """Concrete inputs only: every pool inside a row's context lies on a real page."""
    if not _concrete(page_table_pages, context_pools):
        return
    table = np.asarray(page_table_pages)
    ctx = np.asarray(context_pools).reshape(table.shape[0], -1)
    p = s.page_rows
    need = addr.pages_for_pools(s, np.maximum(ctx, 0).max(axis=1, initial=0))  # [B] columns
    if (need > table.shape[1]).any():
        b = int(np.argmax(need > table.shape[1]))
        raise ValueError(f"{op}: request {b} has {int(ctx[b].max())} context pools but its page table "
                         f"holds {table.shape[1]} pages of {p} pools")
    col = np.arange(table.shape[1])[None, :]
    used = col < need[:, None]
    bad = used & ~addr.page_valid(s, table)
    if bad.any():
        b, c = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{op}: page table entry [{b}, {c}] = {int(table[b, c])} is not a page of this "
                         f"layer (0 .. {addr.num_pages(s) - 1}) but lies inside the context")


def _check_read_inputs(op, cache, layout, q8, weights, page_table_pages, per_row_name, per_row):
    """Common checks of the read ops; returns (q8, weights) padded and (B, n, padded heads)."""
    _check_cache(op, cache, layout)
    q8, weights = _check_queries(op, q8, weights)
    b, n, hp, _ = q8.shape
    _check(op, "page_table_pages", page_table_pages, (b, page_table_pages.shape[-1]), _INT)
    _check(op, per_row_name, per_row, (b, n), _INT)
    return q8, weights, (b, n, hp)


def paged_logits(cache, layout: CacheLayout, layer: int, q8, weights, page_table_pages, context_pools, *,
                 implementation=None, interpret=None):
    """Indexer logits over each request's own pages (docs/semantics.md 2.4, 5.7, 5.8).

    q8: [B, n, H, 128] float8_e4m3fn; weights: [B, n, H] f32 with the q-scale and
    128**-0.5 * H**-0.5 folded (``prepare_queries``; heads other than 32 / 64 are
    zero-padded here); page_table_pages: [B, max_pages] i32
    page ids (pool m of request b is row m % P of page table[b, m // P]);
    context_pools: [B, n] i32 pools visible to each query row.
    Returns [B, n, max_pages * page_rows] f32:
    logit[m] = sum_h w'[h] relu(dot(q8[h], K8[m]) * kscale[m]) for m < context, -inf after.
    Prefill: B = 1 and n = the request's query rows.
    """
    op = "paged_logits"
    q8, weights, (b, n, hp) = _check_read_inputs(op, cache, layout, q8, weights, page_table_pages,
                                                 "context_pools", context_pools)
    s = layout.strides(layer)
    _check_page_table(op, page_table_pages, context_pools, layout, s)
    impl = _read_impl(op, implementation, s, hp)
    return DISPATCH[op, impl](cache, s, q8, weights, page_table_pages, context_pools, interpret=interpret)


def _check_rows_and_count(op, name, x, shape_text, dtypes, per_row_name, per_row, count_name, count):
    """x: a 2-D array of dtypes; per_row: [rows] int32; count: a positive Python int."""
    if x.ndim != 2:
        raise ValueError(f"{op}: {name} must be {shape_text}, got {tuple(x.shape)}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"{op}: {count_name} must be a positive int, got {count!r}")
    _check(op, name, x, x.shape, dtypes)
    _check(op, per_row_name, per_row, x.shape[:1], _INT)


def topk_pools(logits, lengths, k: int, *, implementation=None, interpret=None, splits=None):
    """Exact, deterministic top-k pools per row (docs/semantics.md 2.5, 5.9).

    logits: [rows, n] f32; lengths: [rows] i32 (pools >= length are invalid).
    Returns [rows, k] i32: descending score, ties by ascending pool id, then -1 for
    the slots of a row with fewer than k valid pools. ``splits`` (Pallas only)
    sets how many programs share a row (default: chosen from the shape).
    implementation=None on a GPU: the Triton top-k where ``tc_topk_by_default`` says
    so for the shape (and neither ``splits`` nor ``interpret`` is given), else
    DEFAULT_ORDER's.
    """
    op = "topk_pools"
    _check_rows_and_count(op, "logits", logits, "[rows, n]", _F32, "lengths", lengths, "k", k)
    impl = _impl(op, implementation)
    if (implementation is None and splits is None and not interpret and impl == "pallas"
            and tc_topk_by_default(*logits.shape, k) and _available("triton", op, jax.default_backend())):
        impl = "triton"
    if impl == "triton" and splits is not None:
        raise ValueError(f"{op}: splits is a Pallas launch parameter; implementation='triton' takes none")
    return DISPATCH[op, impl](logits, lengths, k, splits=splits, interpret=interpret)


def expand_pools(pool_ids, seq_lens_tokens, kpool: int, *, implementation=None, interpret=None):
    """Selected pools -> token indices, plus the incomplete-pool tail (docs/semantics.md 5.10).

    pool_ids: [rows, k] i32 (-1 = empty); seq_lens_tokens: [rows] i32 (p + 1 for a
    query at position p, <= 0 for padding). Returns [rows, k*kpool + kpool - 1] i32.
    Pool ids outside [0, seq_len // kpool) are rejected (-1), never expanded.
    """
    op = "expand_pools"
    _check_rows_and_count(op, "pool_ids", pool_ids, "[rows, k]", _INT, "seq_lens_tokens", seq_lens_tokens,
                          "kpool", kpool)
    return DISPATCH[op, _impl(op, implementation)](pool_ids, seq_lens_tokens, kpool, interpret=interpret)


def select_tokens(cache, layout: CacheLayout, layer: int, q8, weights, page_table_pages, positions, *,
                  topk_tokens: int | None = None, short_context=None, implementation=None,
                  interpret=None, path: str | None = None, workspace_bytes: int | None = None,
                  order: str = "score"):
    """Token indices each query row attends to: the whole read path of one layer (docs/semantics.md 1.3).

    q8: [B, n, H, 128] float8_e4m3fn and weights: [B, n, H] f32 from
    ``prepare_queries`` (heads padded to 32 / 64 if not already); page_table_pages: [B, max_pages] i32; positions: [B, n] i32
    absolute position of each query row (-1 = padding row). Decode: B requests of
    n = next_n rows; prefill: B = 1, n = query rows of the request.

    Returns [B * n, topk_tokens + kpool - 1] i32 request-relative token indices,
    rows in (b, j) order: the topk_tokens / kpool best visible pools (pool m is
    visible to a row at position p iff m < (p + 1) // kpool) expanded to their
    tokens in order of descending score (ties: lower pool id first), then the
    row's incomplete-pool tail tokens; -1 marks empty columns (all of a padding
    row). ``order="pool"``: the same pools in ascending pool id order (the tokens in
    position order, the -1 columns after them; ``reference.pool_order``): the Triton
    prefill rows sort only their ids where the score order sorts (score, id) pairs
    (faster), the other paths sort their ids after the top-k.
    Short-context path (docs/semantics.md 5.5): when every row's context p + 1 is <=
    topk_tokens, scoring is skipped and row p holds 0, 1, ..., p, then -1 (the same
    token set). ``short_context`` forces (True/False) or auto-detects (None; on
    traced positions the choice is a lax.cond on the device).

    implementation="pallas": ``path="unfused"`` runs paged_logits then the top-k
    kernel on bounded chunks of query rows; ``path="fused"`` runs the fused logits
    -> top-k kernel (paged_topk.py), which never writes logits to memory at all.
    Both finish with the expansion kernel. ``path=None`` (the default) picks by the
    query rows per request (``default_read_path``): unfused for decode (the faster
    there), fused for prefill chunks of FUSED_MIN_ROWS rows or more (faster at 32k
    tokens; at 128k the unfused path is 1.2x faster but writes and re-reads the
    logits, see ``default_read_path``; docs/benchmarks.md).

    implementation="triton": the tensor-core logits kernel, then the Triton top-k: one
    program per row for prefill chunks (TC_MIN_ROWS or more query rows per request,
    the default there on a GPU), the split top-k for decode rows (candidates from many
    programs per row, then a rank launch of several programs per row that writes the
    token indices: four launches in all). Both read the same logit bits for a row, so
    they select the same tokens; both hold at most ``workspace_bytes`` (default 1 GiB)
    of logits, top-k buffers and results at a time.
    """
    op = "select_tokens"
    ref.check_order(op, order)
    q8, weights, (b, n, hp) = _check_read_inputs(op, cache, layout, q8, weights, page_table_pages,
                                                 "positions", positions)
    c = layout.config
    t = c.topk if topk_tokens is None else topk_tokens
    if not isinstance(t, int) or isinstance(t, bool) or t < c.kpool or t % c.kpool:
        raise ValueError(f"{op}: topk_tokens must be a positive multiple of kpool ({c.kpool}), got {t!r}")
    if path is not None and path not in READ_PATHS:
        raise ValueError(f"{op}: path must be one of {READ_PATHS} or None, got {path!r}")
    if workspace_bytes is not None:
        try:
            _workspace.check_workspace_bytes(workspace_bytes)
        except ValueError as e:
            raise ValueError(f"{op}: {e}") from None
    s = layout.strides(layer)
    r = c.kpool
    short = ref.use_short_path(positions, t, short_context)
    if short is not True and _concrete(positions):
        _check_page_table(op, page_table_pages, ref.seq_lens_from_positions(positions) // r, layout, s)
    # a Pallas path or interpret mode named with implementation=None asks for the Pallas kernels
    impl = _read_impl(op, implementation, s, hp, rows_per_request=n if path is None and not interpret else None)
    if impl == "triton" and path is not None:
        raise ValueError(f"{op}: path selects between the Pallas kernels; implementation='triton' takes none")
    if impl == "triton" and interpret:
        raise ValueError(f"{op}: implementation='triton' has no interpret mode (jax_triton compiles for "
                         f"GPUs only); use implementation='pallas' with interpret=True on CPU")
    return DISPATCH[op, impl](cache, s, q8, weights, page_table_pages, positions, t, short,
                              interpret=interpret, path=path, workspace_bytes=workspace_bytes, order=order)


def _select_tokens_with(pool_ids, s, q8, positions, t, short, interpret, token_ids=None, order="score",
                        pool_ids_in_order=False):
    """select_tokens' frame shared by the kernel implementations: the causal fill, or
    ``token_ids(positions, k)`` ([B, n] positions -> [B, n, width] token indices, expanded
    by its own kernels; None where it does not apply), or else ``pool_ids(ctx, k)`` ([B, n]
    visible pools -> [B, n, k] selected pool ids) expanded to tokens by the expansion
    kernel; ``short`` as ``reference.use_short_path`` returns it. With order="pool" the
    pool ids (or the tokens of token_ids' pool columns) are sorted
    (``reference.pool_order``) unless ``pool_ids_in_order`` says pool_ids gives them so."""
    b, n = q8.shape[:2]
    r = s.kpool
    k, width = t // r, t + r - 1

    def fill():
        return ref.causal_fill(positions, width).reshape(b * n, width)

    def sparse():
        tokens = None if token_ids is None else token_ids(positions, k)
        if tokens is not None:
            tokens = tokens.reshape(b * n, width)
            if order == "pool":
                tokens = jnp.concatenate([ref.pool_order(tokens[:, :k * r]), tokens[:, k * r:]], axis=1)
            return tokens
        seq = ref.seq_lens_from_positions(positions)                                # [B, n]
        ids = pool_ids(seq // r, k)
        if order == "pool" and not pool_ids_in_order:
            ids = ref.pool_order(ids)
        return _expand.expand_pools(ids.reshape(b * n, k), seq.reshape(-1), r, interpret=interpret)

    return ref.branch_short(short, fill, sparse)


def _select_tokens_pallas(cache, s, q8, weights, page_table_pages, positions, t, short, *, interpret, path,
                          workspace_bytes, order):
    """select_tokens with implementation="pallas": the fused paged_topk, or paged_logits +
    top-k on bounded row chunks (``path``, ``default_read_path``)."""
    b, n = q8.shape[:2]

    def pool_ids(ctx, k):
        if (path or default_read_path(n)) == "fused":
            return _paged_topk.paged_topk(cache, s, q8, weights, page_table_pages, ctx, k, interpret=interpret)

        def rows(q, w, cx):                                    # bounded logits per call
            bb, cn = cx.shape
            lg = _paged_logits.paged_logits(cache, s, q, w, page_table_pages, cx, interpret=interpret)
            return _topk_kernel(lg.reshape(bb * cn, -1), cx.reshape(-1), k, interpret=interpret).reshape(bb, cn, k)

        chunk = ref.query_row_chunk(n, 1, addr.pools_in_pages(s, page_table_pages.shape[1]), b,
                                    budget_bytes=workspace_bytes)
        return ref.map_query_rows(rows, chunk, q8, weights, ctx)

    return _select_tokens_with(pool_ids, s, q8, positions, t, short, interpret, order=order)


def _select_tokens_triton(cache, s, q8, weights, page_table_pages, positions, t, short, *, interpret, path,
                          workspace_bytes, order):
    """select_tokens with implementation="triton": chunks of query rows (at most
    ``workspace_bytes`` of logits and top-k buffers at a time,
    ``pallas_kernels.read.workspace``) through the tensor-core logits kernel and the
    Triton top-k: for prefill chunks one program per row (``topk_rows.DEFAULT``: the
    logits kernel also writes group maxima, and a row reads only the groups whose
    maximum reaches its floor; the register form stays off, slower through the whole
    op), then the expansion kernel; for decode rows (fewer
    than TC_MIN_ROWS per request) the split top-k, whose rank launch writes the token
    indices itself."""
    tc_logits = importlib.import_module("pallas_kernels.triton_lang.prefill_logits")
    tc_topk = importlib.import_module("pallas_kernels.triton_lang.topk_rows")
    tc_split = importlib.import_module("pallas_kernels.triton_lang.split_topk")
    b, n = q8.shape[:2]
    r = s.kpool
    n_cols = addr.pools_in_pages(s, page_table_pages.shape[1])

    def chunk_of(k, tokens_per_row=0):
        return _workspace.rows_per_chunk(n, n_cols, k, batch=b, workspace_bytes=workspace_bytes,
                                         tokens_per_row=tokens_per_row)

    def pool_ids(ctx, k):                                      # prefill chunks: one program per row
        def rows(first, cx):                                   # [B, chunk] rows -> [B, chunk, k] pool ids
            bb, cn = cx.shape                                  # (the kernel reads rows first .. first + cn - 1
                                                               # of the whole q8 / weights)
            tune = tc_topk.DEFAULT
            if not tc_topk.needs_maxima(n_cols, tune):         # every row fits the register form
                lg = tc_logits.paged_logits(cache, s, q8, weights, page_table_pages, cx, fill=False,
                                            tune=tc_logits.PREFILL, first_row=first)
                ids = tc_topk.topk_pools(lg.reshape(bb * cn, -1), cx.reshape(-1), k, tune=tune, order=order)
            else:
                lg, mx = tc_logits.paged_logits(cache, s, q8, weights, page_table_pages, cx, fill=False, maxima=True,
                                                tune=tc_logits.PREFILL, first_row=first)
                ids = tc_topk.topk_pools(lg.reshape(bb * cn, -1), cx.reshape(-1), k, mx.reshape(bb * cn, -1),
                                         tune=tune, order=order)
            return ids.reshape(bb, cn, k)

        return ref.map_query_rows(rows, chunk_of(k), ctx, window_start=True)

    def token_ids(pos, k):                                     # decode rows: the split top-k, expanded
        if n >= TC_MIN_ROWS:
            return None
        chunk = chunk_of(k, tokens_per_row=k * r + r - 1)
        if b * chunk > _workspace.MAX_GRID_ROWS:
            return None
        mp = _workspace.split_maxima_pools(n_cols)

        def rows(q, w, p):                                     # [B, chunk] rows -> [B, chunk, width] tokens
            bb, cn = p.shape                                   # (the kernels read the positions themselves)
            lg, mx, zeros = tc_logits.paged_logits(cache, s, q, w, page_table_pages, p, fill=False, maxima=True,
                                                   maxima_pools=mp, tune=tc_logits.DECODE, positions_kpool=r,
                                                   counters=True)
            tok = tc_split.select_tokens_split(lg.reshape(bb * cn, -1), p.reshape(-1), k, mx.reshape(bb * cn, -1),
                                               mp, r, zeros.reshape(-1))
            return tok.reshape(bb, cn, -1)

        return ref.map_query_rows(rows, chunk, q8, weights, pos)

    return _select_tokens_with(pool_ids, s, q8, positions, t, short, interpret, token_ids=token_ids, order=order,
                               pool_ids_in_order=True)


def _triton_kernel(module: str, name: str):
    """Table entry for a kernel of ``pallas_kernels.triton_lang.<module>``, imported on its
    first call: those modules import ``triton``, so they load only after ``_impl`` has
    checked (``_triton.require``) that jax_triton can run here."""
    def call(*args):
        return getattr(importlib.import_module(f"pallas_kernels.triton_lang.{module}"), name)(*args)
    return call


_triton_seed_tail = _triton_kernel("tail_seed", "seed_tail")
_triton_compress_prefill = _triton_kernel("pool_compress", "compress_prefill")
_triton_decode_update = _triton_kernel("decode_update", "decode_update")
_triton_paged_logits = _triton_kernel("prefill_logits", "paged_logits")
_triton_topk = _triton_kernel("dense_topk", "topk_pools")

# =================================================================================
# ONE dispatch table: (op, implementation) -> function. The entries of an op all take
# the same arguments, the op's checked inputs with the layer's strides `s` in place
# of (layout, layer); the reference and the Triton kernels have no interpret mode
# and ignore it. An implementation missing for an op is rejected by _impl before
# any lookup (triton: the write ops only).
# =================================================================================
DISPATCH = {
    ("seed_tail", "xla"):
        lambda cache, s, key, gate, tslot, ends, *, interpret: ref.seed_tail_strides(cache, s, key, gate, tslot,
                                                                                     ends),
    ("seed_tail", "pallas"):
        lambda cache, s, key, gate, tslot, ends, *, interpret: _tail_seed.seed_tail(
            cache, s, key, gate, tslot, ends, interpret=interpret),
    ("seed_tail", "triton"):
        lambda cache, s, key, gate, tslot, ends, *, interpret: _triton_seed_tail(cache, s, key, gate, tslot, ends),

    ("compress_prefill", "xla"):
        lambda cache, s, key, gate, ape, slots, *, interpret: ref.compress_prefill_strides(
            cache, s, key, gate, ape, slots),
    ("compress_prefill", "pallas"):
        lambda cache, s, key, gate, ape, slots, *, interpret: _pool_compress.compress_prefill(
            cache, s, key, gate, ape, slots, interpret=interpret),
    ("compress_prefill", "triton"):
        lambda cache, s, key, gate, ape, slots, *, interpret: _triton_compress_prefill(
            cache, s, key, gate, ape, slots),

    ("decode_update", "xla"):
        lambda cache, s, key, gate, ape, slots, tslot, pos, *, interpret: ref.decode_update_strides(
            cache, s, key, gate, ape, slots, tslot, pos),
    ("decode_update", "pallas"):
        lambda cache, s, key, gate, ape, slots, tslot, pos, *, interpret: _decode_update.decode_update(
            cache, s, key, gate, ape, slots, tslot, pos, interpret=interpret),
    ("decode_update", "triton"):
        lambda cache, s, key, gate, ape, slots, tslot, pos, *, interpret: _triton_decode_update(
            cache, s, key, gate, ape, slots, tslot, pos),

    ("fwht_quant", "xla"): lambda q, *, interpret: ref.fwht_quant(q),
    ("fwht_quant", "pallas"): lambda q, *, interpret: _query_quant.fwht_quant(q, interpret=interpret),

    ("paged_logits", "xla"):
        lambda cache, s, q8, w, table, ctx, *, interpret: ref.paged_logits_strides(cache, s, q8, w, table, ctx),
    ("paged_logits", "pallas"):
        lambda cache, s, q8, w, table, ctx, *, interpret: _paged_logits.paged_logits(
            cache, s, q8, w, table, ctx, interpret=interpret),
    ("paged_logits", "triton"):
        lambda cache, s, q8, w, table, ctx, *, interpret: _triton_paged_logits(cache, s, q8, w, table, ctx),

    ("topk_pools", "xla"): lambda logits, lengths, k, *, splits, interpret: ref.topk_pools(logits, lengths, k),
    ("topk_pools", "pallas"):
        lambda logits, lengths, k, *, splits, interpret: _topk_kernel(
            logits, lengths, k, splits=splits, interpret=interpret),
    ("topk_pools", "triton"): lambda logits, lengths, k, *, splits, interpret: _triton_topk(logits, lengths, k),

    ("expand_pools", "xla"): lambda ids, seq, kpool, *, interpret: ref.expand_pools(ids, seq, kpool),
    ("expand_pools", "pallas"):
        lambda ids, seq, kpool, *, interpret: _expand.expand_pools(ids, seq, kpool, interpret=interpret),

    ("select_tokens", "xla"):
        lambda cache, s, q8, w, table, positions, t, short, *, interpret, path, workspace_bytes, order:
        ref.select_tokens_strides(cache, s, q8, w, table, positions, t,
                                  short_context=short if isinstance(short, bool) else None,
                                  budget_bytes=workspace_bytes, order=order),
    ("select_tokens", "pallas"): _select_tokens_pallas,
    ("select_tokens", "triton"): _select_tokens_triton,
}
