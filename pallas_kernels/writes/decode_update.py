"""Kernel: batched decode update with pool completion (docs/semantics.md 5.4).

Touches ONLY, per request b and token t (in index = position order):
  * if the token completes a pool (pos % kpool == kpool-1, valid pool slot loc and
    valid tail slot: ``addressing.decode_completes``): the 128 key bytes and 4 scale
    bytes of pool slot loc;
  * if pos >= 0 and its tail slot is valid: the 2 x 256 bytes of ring row
    pos % ring of its own tail block (tslot // ring).
It reads the kpool-1 earlier members of a completing pool from the same ring.

Grid: one program per request. The bytes are those of the walk of docs/semantics.md
5.4: token by token in order, each completion reading the ring before the token's own
stash, so a
completion at the last token of a verify window sees stashes written by earlier
tokens of the same launch. n, the static width of the [B, n] arrays, bounds the
tokens; padding tokens (pos < 0) do nothing, so fewer or uneven tokens per
request use the same compiled kernel. Two programs give those bytes:

"forward" (verify windows with n * (kpool - 1) <= FORWARD_MAX_PAIRS, e.g. up to
10 tokens at kpool 4): no memory round trip per token. (With one token, step 3 comes
first: see ``_stash_first``; one token also takes the forms of ``_apes_in_branch``,
``_knockout_weights`` and ``_stores_keep_parts``, measured faster there only.)
  1. Load every token's metadata and key / gate row at once.
  2. Walk the tokens in order and complete pools. A member's ring row is the one
     the walk would find there: the row of the newest EARLIER token of this launch
     that stashes into the same (block, ring slot), from registers, else the ring's
     bytes from before the launch (loaded: no stash has run yet).
  3. One block barrier (every ring read done), then every token's stash; where two
     tokens of the launch stash into one ring row only the later one writes, so no
     two stores of the launch hit one address.
  Its code grows with n * (kpool - 1) (the forwarding selects), hence the bound: at
  kpool 16 and 32 tokens the H200's Triton compile takes minutes.

"walk" (any n): the walk itself, a block barrier before each completion's reads
and after them, so each token reads the ring after the earlier tokens' stashes.
One dependent round trip to memory per token.

Both give the walk's bytes for any input, including repeated positions and tokens
whose tail slots point at other blocks of the request (tests/test_write_kernels.py
draws such batches against the reference for both).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B
from ..core import addressing as addr
from ..core import numerics as nm
from ..core.strides import CacheStrides

PATHS = ("forward", "walk")
FORWARD_MAX_PAIRS = 32          # n * (kpool - 1) up to which "forward" is the default


def default_path(n: int, kpool: int) -> str:
    return "forward" if n * (kpool - 1) <= FORWARD_MAX_PAIRS else "walk"


def _pick(values, t):
    """values[t] for a traced index t into a static list (a select chain: exact bits)."""
    out = values[0]
    for u in range(1, len(values)):
        out = jnp.where(t == u, values[u], out)
    return out


def _load_apes(ape_ref, tab_ref, r):
    """The R ape rows (R x [128] f32), loaded with every word of the exp table, and a
    [128] u32 of zeros that no compiler can see are zeros (for ``_keys_before_exps``).

    A program completes one pool or a few, so its exp lookups (a gather whose indices
    come out of the pooling arithmetic) would each miss L1 and wait on L2 in the
    middle of the completion's dependent chain. Loading the table here, beside the
    other inputs, puts it in L1 first. The load is kept alive by OR-ing each entry's
    sign bit into ape row 0: the entries are 2**(j/64) > 0, so no bit changes.
    """
    j = lax.broadcasted_iota(jnp.int32, (nm.HEAD_DIM,), 0) % nm.EXP_TABLE_SIZE        # [128]
    zero = lax.bitcast_convert_type(B.table_lookup(tab_ref)(j), jnp.uint32) >> 31      # [128] u32, all 0
    ape0 = lax.bitcast_convert_type(lax.bitcast_convert_type(ape_ref[0, :], jnp.uint32) | zero, jnp.float32)
    return [ape0] + [ape_ref[i, :] for i in range(1, r)], zero


def _keys_before_exps(zero, ring_keys, gate0):
    """gate0 [128] bf16, unchanged, made to depend on the ring keys' values.

    Left alone, the H200's compiler issues a completion's ring key loads after the exps,
    where the pooled sum first needs them (Nsight Compute's SASS of next_n 1): a
    second round trip to L2 inside the dependent chain, after the gate rows'. OR-ing
    ``zero & keys`` (zero: the exp table's sign bits, all 0 but opaque) into the gate
    row that every exp depends on puts the key loads beside the gate loads. No bit
    changes: the OR-ed value is 0.
    """
    bits = lax.bitcast_convert_type(ring_keys[0], jnp.uint16).astype(jnp.uint32)      # [128]
    for k in ring_keys[1:]:
        bits = bits | lax.bitcast_convert_type(k, jnp.uint16).astype(jnp.uint32)
    guard = (zero & bits).astype(jnp.uint16)                                          # [128], all 0
    return lax.bitcast_convert_type(lax.bitcast_convert_type(gate0, jnp.uint16) | guard, jnp.bfloat16)


def _ring_row(cache_ref, s, blk, slot, half, mask=True):                            # -> [128] bf16
    w64 = lax.broadcasted_iota(jnp.int32, (addr.TAIL_ROW_WORDS,), 0)
    rr, cc = addr.split_word(s, addr.tail_row_words(s, blk, slot, half) + w64)
    return nm.unpack_bf16_words(B.gather(cache_ref, rr, cc, mask=mask & (w64 >= 0)))


def _word_index(words: int, parts: int, keep_parts: bool):
    """The word index of a row of `words` packed words: [words], or with keep_parts
    [words, parts] (``numerics``' ``pack_*_words(..., keep_parts=True)`` shape)."""
    return lax.broadcasted_iota(jnp.int32, (words, parts) if keep_parts else (words,), 0)


def _storing_lanes(w, keep_parts: bool):
    """The lanes of word index `w` that store: all of a [words] index, those of part 0 of
    a [words, parts] one (every part holds the whole word)."""
    return (lax.broadcasted_iota(jnp.int32, w.shape, 1) == 0) if keep_parts else (w >= 0)


def _stash(cache_ref, s, blk, slot, key_row, gate_row, mask, keep_parts=False):
    """Ring row `slot` of tail block `blk` = the token's key and gate, where mask.
    keep_parts: store from the packing's own shape (``_stores_keep_parts``)."""
    w = _word_index(addr.TAIL_ROW_WORDS, 2, keep_parts)                             # [64] or [64, 2]
    for half, row in ((0, key_row), (1, gate_row)):
        rr, cc = addr.split_word(s, addr.tail_row_words(s, blk, slot, half) + w)
        B.scatter(cache_ref, rr, cc, nm.pack_bf16_words(row, keep_parts), mask & _storing_lanes(w, keep_parts))


def _write_pool(cache_ref, tab_ref, s, apes, keys, gates, loc, interpret, knockout=False, keep_parts=False):
    """Pool the R member rows (R x [128] bf16 each), rotate, quantise, store pool slot loc.
    knockout: the softmax weights by ``numerics.softmax_weights_knockout`` (``_knockout_weights``);
    keep_parts: store the key words from the packing's own shape (``_stores_keep_parts``)."""
    w = _word_index(addr.KEY_WORDS, 4, keep_parts)                                  # [32] or [32, 4]
    numerics = B.kernel_numerics(tab_ref, interpret)
    if knockout:
        numerics["weights"] = nm.softmax_weights_knockout
    q8, scale = nm.compress_pool(keys, gates, apes, **numerics)                     # [128] fp8, []
    rk, ck = addr.split_word(s, addr.pool_key_words(s, loc) + w)
    B.scatter(cache_ref, rk, ck, nm.pack_fp8_words(q8, keep_parts), _storing_lanes(w, keep_parts))
    rs, cs = addr.split_word(s, addr.pool_scale_words(s, loc))
    cache_ref[rs, cs] = nm.f32_word(scale)


def _forward_kernel(pos_ref, slot_ref, tslot_ref, key_ref, gate_ref, ape_ref, tab_ref, _cache_in, cache_ref, *,
                    s: CacheStrides, n: int, interpret: bool, apes_in_branch: bool):
    # pos_ref, slot_ref, tslot_ref: [B, n] i32; key_ref, gate_ref: [B, n, 128] bf16;
    # ape_ref: [R, 128] f32; tab_ref: [1, 64] f32 (numerics.EXP_TABLE); cache_ref: [rows, 1024] u32
    r = s.kpool
    b = B.program_id(0)
    if not apes_in_branch:                                                          # _apes_in_branch
        apes_zero = _load_apes(ape_ref, tab_ref, r)                                 # R x [128] f32, [128] u32

    # 1. every token's inputs, loaded together (n x scalars, n x [128] bf16 rows)
    pos = [jnp.maximum(pos_ref[b, t], -1) for t in range(n)]                        # -1: padding
    loc = [slot_ref[b, t] for t in range(n)]
    tslot = [tslot_ref[b, t] for t in range(n)]
    keys_in = [key_ref[b, t, :] for t in range(n)]
    gates_in = [gate_ref[b, t, :] for t in range(n)]
    blk = [addr.tail_block(s, ts) for ts in tslot]                  # each token's own block (bug B4)
    ring_slot = [jnp.maximum(p, 0) % s.ring for p in pos]
    stashes = [addr.decode_stashes(s, pos[t], tslot[t]) for t in range(n)]             # gated on tslot (B3)

    # 2. the walk's completions, in token order
    def token(t, carry):
        p_t, loc_t, blk_t = _pick(pos, t), _pick(loc, t), _pick(blk, t)
        complete = addr.decode_completes(s, p_t, loc_t, _pick(tslot, t))

        @B.when(complete)
        def _complete():
            apes, zero = _load_apes(ape_ref, tab_ref, r) if apes_in_branch else apes_zero
            keys, gates, ring_keys = [], [], []
            for j in range(r - 1):
                slot = (p_t - (r - 1) + j) % s.ring
                fwd, k_fwd, g_fwd = False, keys_in[0], gates_in[0]
                for u in range(n):              # the newest earlier stash into (blk_t, slot) wins
                    hit = (u < t) & stashes[u] & (blk[u] == blk_t) & (ring_slot[u] == slot)
                    fwd = fwd | hit
                    k_fwd = jnp.where(hit, keys_in[u], k_fwd)
                    g_fwd = jnp.where(hit, gates_in[u], g_fwd)
                ring_keys.append(_ring_row(cache_ref, s, blk_t, slot, 0, ~fwd))
                keys.append(jnp.where(fwd, k_fwd, ring_keys[-1]))
                gates.append(jnp.where(fwd, g_fwd, _ring_row(cache_ref, s, blk_t, slot, 1, ~fwd)))
            keys.append(_pick(keys_in, t))
            gates.append(_pick(gates_in, t))
            if ring_keys:
                gates[0] = _keys_before_exps(zero, ring_keys, gates[0])
            _write_pool(cache_ref, tab_ref, s, apes, keys, gates, loc_t, interpret, _knockout_weights(n),
                        _stores_keep_parts(n))

        return carry

    # 3. every stash, after every ring read of the program (or, one token, before them)
    def stash_all():
        for t in range(n):
            write = stashes[t]
            for u in range(t + 1, n):           # unless a later token of the launch stashes into the same row
                write = write & ~(stashes[u] & (blk[u] == blk[t]) & (ring_slot[u] == ring_slot[t]))
            _stash(cache_ref, s, blk[t], ring_slot[t], keys_in[t], gates_in[t], write, _stores_keep_parts(n))

    if _stash_first(n):
        stash_all()
        lax.fori_loop(0, n, token, 0)
    else:
        lax.fori_loop(0, n, token, 0)
        B.barrier(interpret)
        stash_all()


APES_IN_BRANCH_MIN_REQUESTS = 64


def _apes_in_branch(tokens_per_request: int, requests: int) -> bool:
    """Whether the forward program loads the ape rows and the exp table inside its
    completion branch (only the programs that complete a pool load them) instead of at
    its start beside the token rows (every program): for one token per request in
    batches of at least APES_IN_BRANCH_MIN_REQUESTS. There a quarter of the programs (at
    kpool 4) complete a pool, and the others no longer compete with them for the same
    2.3 KiB of L2 lines. H200 device spans (the same bytes; docs/benchmarks.md): at
    next_n 1 B = 64 / 256 1.82 / 2.02 us against 1.92 / 2.18 with the loads at the start,
    but B = 1 1.73 against 1.66 (the loads move onto the completion's chain), and at
    next_n 4, where every program completes, 0.13-0.25 us slower at every B."""
    return tokens_per_request == 1 and requests >= APES_IN_BRANCH_MIN_REQUESTS


def _knockout_weights(tokens_per_request: int) -> bool:
    """Whether the forward program takes the pooling's weights by a knockout (three exps
    for kpool 4's four scores and six selects, ``numerics.softmax_weights_knockout``; the
    same bytes): for one token per request. H200 device spans (docs/benchmarks.md): at
    next_n 1, B = 256 1.98 us against 2.02-2.05 with four exps (B = 1 level); at next_n 4,
    where every program completes a pool, 2.62-2.66 against 2.46-2.50 (B = 1 2.05
    against 1.86); compression too is 2-4 % slower with it (``_backend.kernel_numerics``)."""
    return tokens_per_request == 1


def _stores_keep_parts(tokens_per_request: int) -> bool:
    """Whether the forward program stores its packed words (the pool's 32 key words, the
    stash's 2 x 64 ring words) from the packing sum's own shape, each word repeated along
    its bytes' axis and stored by the lanes of byte 0, instead of moving the [32] / [64]
    words into a layout of their own first (``numerics.pack_fp8_words(..., keep_parts=True)``;
    the same bytes): for one token per request. H200 device spans (docs/benchmarks.md):
    at next_n 1, B = 256 1.92 us for each of the two stores so formed against 1.95-1.98,
    B = 1 1.63 against 1.66; at next_n 4 0.13-0.26 us slower (each store, B = 256 and 1)."""
    return tokens_per_request == 1


def _stash_first(tokens_per_request: int) -> bool:
    """Whether the forward program may stash before its completions: for one token. Its
    completion reads ring slots (pos - j) % ring, 1 <= j < kpool <= ring, and its stash
    writes pos % ring: never one of them, so no barrier orders the two and the stash's
    stores leave while the completion waits on its ring loads. With more tokens a later
    token may stash into a row an earlier completion reads from the ring."""
    return tokens_per_request == 1


def _walk_kernel(pos_ref, slot_ref, tslot_ref, key_ref, gate_ref, ape_ref, tab_ref, _cache_in, cache_ref, *,
                 s: CacheStrides, n: int, interpret: bool):
    # the same refs as _forward_kernel
    r = s.kpool
    b = B.program_id(0)
    apes, zero = _load_apes(ape_ref, tab_ref, r)                                    # R x [128] f32, [128] u32

    def token(t, carry):
        pos = pos_ref[b, t]
        tslot = tslot_ref[b, t]
        loc = slot_ref[b, t]
        blk = addr.tail_block(s, tslot)                     # this token's own block (bug B4)
        pos_c = jnp.maximum(pos, 0)
        complete = addr.decode_completes(s, pos, loc, tslot)
        B.barrier(interpret)                                # earlier tokens' stashes are visible

        @B.when(complete)
        def _complete():
            slots = [(pos_c - (r - 1) + j) % s.ring for j in range(r - 1)]
            ring_keys = [_ring_row(cache_ref, s, blk, sl, 0) for sl in slots]
            keys = ring_keys + [key_ref[b, t, :]]
            gates = [_ring_row(cache_ref, s, blk, sl, 1) for sl in slots] + [gate_ref[b, t, :]]
            if ring_keys:
                gates[0] = _keys_before_exps(zero, ring_keys, gates[0])
            _write_pool(cache_ref, tab_ref, s, apes, keys, gates, loc, interpret)

        B.barrier(interpret)                                # reads above finish before the stash
        _stash(cache_ref, s, blk, pos_c % s.ring, key_ref[b, t, :], gate_ref[b, t, :],
               addr.decode_stashes(s, pos, tslot))          # gated on the tail slot (bug B3)
        return carry

    lax.fori_loop(0, n, token, 0)


NUM_WARPS_ONE_TOKEN = 4    # next_n 1
NUM_WARPS_WINDOW = 2       # next_n >= 2 (verify windows)


def default_num_warps(tokens_per_request: int) -> int:
    """Warps per program for the launch's tokens per request (n, next_n). H200 device spans
    (docs/benchmarks.md, "Decode update warps"): at next_n 4, 2 warps 2.72 against 2.94 us
    with 4 at B = 256; at next_n 1, 4 warps 1.95 / 1.73 / 1.57 us at B = 256 / 64 / 1
    against 1.95 / 1.85 / 1.70 with 2; 1 and 8 warps slower everywhere."""
    return NUM_WARPS_WINDOW if tokens_per_request > 1 else NUM_WARPS_ONE_TOKEN


@functools.partial(jax.jit, static_argnames=("s", "interpret", "num_warps", "path", "apes_in_branch"))
def decode_update(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions, *,
                  interpret=None, num_warps: int | None = None, path: str | None = None,
                  apes_in_branch: bool | None = None):
    """cache: [total_words] u32; key, gate: [B, n, 128] bf16; ape [R, 128] f32;
    slot_mapping, tslot, positions: [B, n] i32. Returns the new cache.
    num_warps: launch shape (None: ``default_num_warps(n)``; ``benchmarks/trace_writes.py
    --decode-variants``); path: "forward" or "walk" (the module docstring; None:
    ``default_path(n, kpool)``); apes_in_branch: where "forward" loads the ape rows and
    the exp table (None: ``_apes_in_branch(n, B)``); the same bytes whatever the choice."""
    b, n = positions.shape
    if b == 0 or n == 0:
        return cache
    path = default_path(n, s.kpool) if path is None else path
    num_warps = default_num_warps(n) if num_warps is None else num_warps
    if path not in PATHS:
        raise ValueError(f"decode_update: path must be one of {PATHS}, got {path!r}")
    interpret = B.resolve_interpret(interpret)
    if path == "forward":
        in_branch = _apes_in_branch(n, b) if apes_in_branch is None else bool(apes_in_branch)
        kernel = functools.partial(_forward_kernel, s=s, n=n, interpret=interpret, apes_in_branch=in_branch)
    else:
        kernel = functools.partial(_walk_kernel, s=s, n=n, interpret=interpret)
    view = cache.reshape(addr.view_shape(s))
    out = B.pallas_call(
        kernel,
        grid=(b,),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={7: 0},
        interpret=interpret, name="kpool_decode_update", num_warps=num_warps,
    )(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), tslot.astype(jnp.int32),
      key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16), ape.astype(jnp.float32), nm.exp_table_input(), view)
    return out.reshape(-1)
