"""Where the time of the compression kernel goes: the same kernel with parts of its
numerics swapped for cheap (NOT bit-exact) stand-ins, or for candidate forms that
keep every bit, timed in one run.

Usage (on the H200):  PYTHONPATH=$PWD python benchmarks/probe_compress.py [--tokens 32768 131072]
                      [--probes exact,...] [--decode] [--quick]

Each variant patches functions of ``pallas_kernels.core.numerics`` (or, named
``pool_compress.f`` / ``decode_update.f`` / ``backend.f``, helpers of those kernel
files and the backend; the kernel bodies look them up at trace time) and clears JAX's caches. Every call is timed as a device span
from a profiler trace, queued behind a busy kernel (trace_writes.py's method; off the
GPU, host wall time), against a 1 GiB copy and an empty kernel traced the same way.
"exact" is the shipped kernel and the probes in SAME_BITS are candidate forms of it:
their bytes are checked against the XLA reference before they are timed. The other
probes are timing probes whose bytes differ by design. Reported: the span, the
fraction of copy bandwidth (bytes counted as bench_writes.compress_bytes) and the
share of the exact kernel's time the probe removes.

``--profile`` runs each probe once inside the CUDA profiler's window instead (for
``ncu --profile-from-start off``; with ``--decode``, at ``--batches`` x ``--next-n``).

``--decode`` runs the probes on the decode update (B = 256 and 1, next_n 1 and 4)
against the empty kernel; "no pool arithmetic" leaves only its loads, branches and
stores: the latency floor of its memory chain.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax.testing import (session7_exp_f32, session12_e4m3_bits, session12_exp_f32, session12_mac_bf16,
                              session12_recip_f32, session13_hadamard128, session14_compress_pool)
from pallas_kernels.core import addressing as pa
from pallas_kernels.core import backend as pb
from pallas_kernels.core import numerics as nm
from pallas_kernels.writes import decode_update as du
from pallas_kernels.writes import pool_compress as pc
from pallas_kernels.writes.pool_compress import compress_prefill

sys.path.insert(0, os.path.dirname(__file__))
import bench_writes as bw  # noqa: E402
import trace_read as tr  # noqa: E402
import trace_writes as tw  # noqa: E402
from _timing import empty_grid_step, empty_launch_step  # noqa: E402


def hadamard128_unstack(x, zero_plus=None):
    """hadamard128 in session 13's constant-geometry order (each stage moves the pairs
    into a new order) with the pairs taken apart by lax.unstack (a Triton split) like
    the shipped in-place form. Tried in session 14 (run 2): as fast as the in-place form
    in the compression kernel, 2-3 % slower in the decode update. zero_plus (the kernels'
    one-instruction -0 -> +0 since session 17) is ignored: this form keeps its select."""
    lead = x.shape[:-1]
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    x = jax.lax.bitcast_convert_type(jnp.where(u == np.uint32(0x80000000), np.uint32(0), u), jnp.float32)
    for _ in range(7):
        a, b = jax.lax.unstack(x.reshape(lead + (nm.HEAD_DIM // 2, 2)), axis=-1)      # [..., 64] each
        y = jax.lax.stack([a + b, a - b], axis=-1)                                   # [..., 64, 2]
        x = jnp.swapaxes(y, -1, -2).reshape(lead + (nm.HEAD_DIM,))                   # sums, then differences
    return x


def pack_fp8_words_unstack(q8, keep_parts=False):
    """pack_fp8_words by two pairings: bytes (2j, 2j+1) -> halfword j, halfwords (2w, 2w+1)
    -> word w (byte 4w+i at bits 8i, the same words). Tried in session 14 (run 2, with the
    bf16 forms below as "words by unstack"): no change in the compression, the decode
    update 30 % slower."""
    lead = q8.shape[:-1]
    b = jax.lax.bitcast_convert_type(q8, jnp.uint8).astype(jnp.uint32)                # [..., 128]
    lo, hi = jax.lax.unstack(b.reshape(lead + (64, 2)), axis=-1)
    h = lo | (hi << 8)                                                                # [..., 64]
    lo, hi = jax.lax.unstack(h.reshape(lead + (32, 2)), axis=-1)
    return nm._words(lo | (hi << 16), keep_parts, 4)                                  # [..., 32] (keep_parts: [..., 32, 4])


def pack_bf16_words_unstack(x, keep_parts=False):
    lead = x.shape[:-1]
    h = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    lo, hi = jax.lax.unstack(h.reshape(lead + (64, 2)), axis=-1)
    return nm._words(lo | (hi << 16), keep_parts, 2)


def unpack_bf16_words_stack(w):
    lead = w.shape[:-1]
    h = jax.lax.stack([w & np.uint32(0xFFFF), w >> 16], axis=-1)                     # [..., 64, 2]
    return jax.lax.bitcast_convert_type(h.astype(jnp.uint16).reshape(lead + (nm.HEAD_DIM,)), jnp.bfloat16)


def _exp_no_table(d, lookup=None, mul=None):
    """exp_nonpositive_f32 with T[j] = 1 + j * 2**-7 computed, not looked up (timing probe:
    what the table's loads and their addresses cost)."""
    return nm._exp_clamped(jnp.maximum(d, -87.0), lambda j: 1.0 + j.astype(jnp.float32) * (1.0 / 128), mul,
                           scale_by_bits=True)


def _exp_nonpositive_s15(d, lookup=None, mul=None):
    """exp_nonpositive_f32 as in session 15: 2**(k >> 6) built and multiplied in (the same
    bits; session 16 adds (k >> 6) << 23 to the bits of e instead)."""
    return nm._exp_clamped(jnp.maximum(d, -87.0), lookup, mul)


def _kernel_numerics_s16(tab_ref, interpret):
    """backend.kernel_numerics as in session 16: the table lookup and mul_rn only (the
    integer bf16 rounding, the -0 select and the clip: the same bytes)."""
    return dict(exp_lookup=pb.table_lookup(tab_ref), mul=pb.mul_rn(interpret))


_KERNEL_NUMERICS = pb.kernel_numerics


def _kernel_numerics_knockout(tab_ref, interpret):
    """backend.kernel_numerics with the pooling's weights by the knockout (three exps;
    the same bytes): what session 18 run 1 timed in compression."""
    return dict(_KERNEL_NUMERICS(tab_ref, interpret), weights=nm.softmax_weights_knockout)


def _store_pools_in_parent(cache_ref, s, loc, valid, q8, scale):
    """pool_compress._store_pools storing each key word from the packing sum's shape, as the
    decode update does at next_n 1 (decode_update._stores_keep_parts; the same bytes)."""
    shape = q8.shape[:1] + (pa.KEY_WORDS, 4)
    w, j = (jax.lax.broadcasted_iota(jnp.int32, shape, d) for d in (1, 2))              # [TILE, 32, 4]
    rk, ck = pa.split_word(s, pa.pool_key_words(s, loc)[:, None, None] + w)
    pb.scatter(cache_ref, rk, ck, nm.pack_fp8_words(q8, keep_parts=True), valid[:, None, None] & (j == 0))
    rs, cs = pa.split_word(s, pa.pool_scale_words(s, loc))
    pb.scatter(cache_ref, rs, cs, nm.f32_word(scale), valid)


def _ring_row_by_element(cache_ref, s, blk, slot, half, mask=True):
    """decode_update._ring_row gathering at the row's [128] element indices (each word read
    by both of its bf16 elements, then shifted) instead of [64] words unpacked by a reshape."""
    col = jax.lax.broadcasted_iota(jnp.int32, (nm.HEAD_DIM,), 0)                     # [128]
    rr, cc = pa.split_word(s, pa.tail_row_words(s, blk, slot, half) + col // 2)
    w = pb.gather(cache_ref, rr, cc, mask=mask & (col >= 0))
    h = (w >> ((col % 2) * 16).astype(jnp.uint32)) & jnp.uint32(0xFFFF)
    return jax.lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.bfloat16)


def _unguarded(zero, ring_keys, gate0):
    """decode_update._keys_before_exps before session 15: no dependency, so the compiler
    may issue the ring key loads after the exps."""
    return gate0


def _plain_mac(c, a, b, mul=None):
    return c + a * b


def _fast_exp(d, lookup=None, mul=None):
    return jnp.exp(jnp.clip(d, -87.0, 88.0))


def _fast_recip(b, mul=None):
    return 1.0 / b


def _without_mul(f, n, keep=()):
    """An older numerics form with n positional arguments (and the keywords in `keep`) in the
    place of one that also takes ``mul`` (positional after them, or named)."""
    return lambda *a, **kw: f(*a[:n], **{k: kw[k] for k in keep if k in kw})


def _no_hadamard(x, zero_plus=None):
    return x


def _no_pool_arithmetic(keys, gates, ape_rows, **kernel_numerics):
    """compress_pool's shapes with none of its work: the newest member's key as the fp8
    row, its largest element as the scale (a reduction, since the Pallas Triton lowering
    has no slice). The stores stay; loads whose values nothing uses any more (the gates,
    the older members, in the decode update their ring rows) may be dropped by the
    compiler, so this times a lower bound of the kernel's memory work: at 128k tokens
    the compression took 8.83 us, faster than a copy of its inputs (session 13)."""
    k = keys[-1].astype(jnp.float32)
    return jnp.clip(k, -nm.FP8_MAX, nm.FP8_MAX).astype(nm.FP8), jnp.max(k, axis=-1)


PROBES = {
    "exact": {},
    # candidate forms with the same bits as "exact" (checked before timing)
    "e4m3 from bit ops": {"e4m3_bits": session12_e4m3_bits},       # sessions 1-12
    "session-13 hadamard": {"hadamard128": lambda x, zero_plus=None: session13_hadamard128(x)},  # sessions 1-13
    "hadamard unstack": {"hadamard128": hadamard128_unstack},
    "words by unstack": {"pack_fp8_words": pack_fp8_words_unstack, "pack_bf16_words": pack_bf16_words_unstack,
                         "unpack_bf16_words": unpack_bf16_words_stack},
    # sessions 13-14's forms of what session 15 changed (each the same bytes)
    "session-14 pooling": {"compress_pool": _without_mul(session14_compress_pool, 3, keep=("exp_lookup",))},
    "ring keys unguarded": {"decode_update._keys_before_exps": _unguarded},
    "stash last": {"decode_update._stash_first": lambda n: False},
    "apes in branch": {"decode_update._apes_in_branch": lambda n, b: True},
    "apes at start": {"decode_update._apes_in_branch": lambda n, b: False},
    "all session-14": {"compress_pool": _without_mul(session14_compress_pool, 3, keep=("exp_lookup",)),
                       "decode_update._keys_before_exps": _unguarded},
    # session 15's forms of what session 16 changed (each the same bytes)
    "mul by rounded": {"backend.mul_rn": lambda interpret: None},
    "exp power by multiply": {"exp_nonpositive_f32": _exp_nonpositive_s15},
    "session-15 numerics": {"backend.mul_rn": lambda interpret: None, "exp_nonpositive_f32": _exp_nonpositive_s15},
    # session 16's forms of session 17's kernel-only operations (the same bytes)
    "session-16 kernel ops": {"backend.kernel_numerics": _kernel_numerics_s16},
    # session 18: the pooling's weights by a knockout (three exps; the same bytes), the decode
    # update's rule (knockout at next_n 1) either way, the key words stored from the packing's layout
    "knockout": {"backend.kernel_numerics": _kernel_numerics_knockout,
                 "decode_update._knockout_weights": lambda n: True},
    "four exps": {"decode_update._knockout_weights": lambda n: False},
    "words in parent": {"pool_compress._store_pools": _store_pools_in_parent},
    "stores by words": {"decode_update._stores_keep_parts": lambda n: False},
    "session-17 decode": {"decode_update._stores_keep_parts": lambda n: False,
                          "decode_update._knockout_weights": lambda n: False},
    "ring by element": {"decode_update._ring_row": _ring_row_by_element},
    # timing probes (bytes differ by design)
    # same-run baseline: sessions 8-12's exact-product numerics and integer e4m3 code
    "session-12 numerics": {"exp_nonpositive_f32": _without_mul(session12_exp_f32, 2),
                            "mac_bf16": _without_mul(session12_mac_bf16, 3),
                            "recip_f32": _without_mul(session12_recip_f32, 1), "e4m3_bits": session12_e4m3_bits},
    "session-7 numerics": {"exp_nonpositive_f32": _without_mul(session7_exp_f32, 2), "mac_bf16": _without_mul(nm.mac, 3),
                           "recip_f32": _without_mul(session12_recip_f32, 1)},
    "mac -> c + a*b": {"mac": _plain_mac, "mac_bf16": _plain_mac},
    "exp -> jnp.exp": {"exp_nonpositive_f32": _fast_exp},
    "exp no table": {"exp_nonpositive_f32": _exp_no_table},
    "recip -> 1/x": {"recip_f32": _fast_recip},
    "hadamard -> identity": {"hadamard128": _no_hadamard},
    "exp+recip cheap": {"exp_nonpositive_f32": _fast_exp, "recip_f32": _fast_recip},
    "all cheap": {"exp_nonpositive_f32": _fast_exp, "recip_f32": _fast_recip, "mac": _plain_mac,
                  "mac_bf16": _plain_mac, "hadamard128": _no_hadamard},
    "no pool arithmetic": {"compress_pool": _no_pool_arithmetic},
}
SAME_BITS = ("exact", "e4m3 from bit ops", "session-13 hadamard", "hadamard unstack", "words by unstack",
             "session-14 pooling", "ring keys unguarded", "all session-14", "stash last", "mul by rounded",
             "exp power by multiply", "session-15 numerics", "session-16 kernel ops", "apes in branch",
             "apes at start", "knockout", "four exps", "words in parent",
             "stores by words", "session-17 decode", "ring by element")


_MODULES = {"pool_compress": pc, "decode_update": du, "backend": pb}


def _target(name):
    """'fn' -> (numerics, 'fn'); 'pool_compress.fn' / 'decode_update.fn' / 'backend.fn' -> (that module, 'fn')."""
    mod, _, attr = name.rpartition(".")
    return (_MODULES[mod] if mod else nm), attr


@contextlib.contextmanager
def patched(names):
    old = {k: getattr(*_target(k)) for k in names}
    try:
        for k, v in names.items():
            setattr(*_target(k), v)
        jax.clear_caches()
        yield
    finally:
        for k, v in old.items():
            setattr(*_target(k), v)
        jax.clear_caches()


def _check(name, got, want):
    """'' for a timing probe; for a SAME_BITS probe whether its bytes equal the reference's."""
    if name not in SAME_BITS:
        return ""
    return "bytes == reference" if np.array_equal(np.asarray(got), want) else "BYTES DIFFER"


def _tracer(quick, calls):
    busy = tr.busy_kernel(interpret=jax.default_backend() != "gpu")
    busy_arg = jnp.ones((16,), jnp.float32)
    n = 3 if quick else calls

    def span_us(step, state, *args):
        return tw.trace_state_calls(tw.donated(step), state, args, n, busy, busy_arg)[0]["span_us"]
    return span_us


def decode(probes, rng, quick, calls=30, batches=(256, 1), next_ns=(1, 4)):
    """decode_update under each probe: B = 256 and 1 (4 quick), next_n 1 and 4 (or as
    given; bench_writes.decode_case), device spans against an empty kernel."""
    from pallas_kernels.writes.decode_update import decode_update
    span_us = _tracer(quick, calls)
    empty = span_us(empty_launch_step, jnp.zeros((1024,), jnp.uint32))
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"empty Pallas kernel {empty:.2f} us (device span)")
    print(f"{'probe':<24}{'case':>18}{'span us':>10}{'x empty':>9}  note")
    for batch in ((4,) if quick else batches):
        for warps in (2, 4):
            us = span_us(empty_grid_step(batch, warps), jnp.zeros((1024,), jnp.uint32))
            print(f"{'empty kernel':<24}{f'{batch} programs x {warps} warps':>18}{us:>10.2f}{us / empty:>9.2f}  "
                  "launch floor of this grid", flush=True)
        for nn in next_ns:
            layout, _, args = bw.decode_case(rng, batch, nn)
            s = layout.strides(0)
            want = np.asarray(ops.decode_update(layout.allocate(0x5A), layout, 0, *args, implementation="xla"))
            for name, patch in probes:
                with patched(patch):
                    step = lambda c, *x: decode_update(c, s, *x)
                    note = _check(name, step(layout.allocate(0x5A), *args), want)
                    us = span_us(step, layout.allocate(0), *args)
                print(f"{name:<24}{f'B={batch} next_n={nn}':>18}{us:>10.2f}{us / empty:>9.2f}  {note}", flush=True)


def _profiled_call(lib, step, layout, args):
    """step(cache, *args) jitted with the cache donated: a warm-up call, then one call
    between cudaProfilerStart / Stop (libcudart ``lib``; None off the GPU)."""
    f = jax.jit(step, donate_argnums=0)
    c = jax.block_until_ready(f(layout.allocate(0), *args))
    if lib is not None:
        lib.cudaProfilerStart()
    jax.block_until_ready(f(c, *args))
    if lib is not None:
        lib.cudaProfilerStop()


def profile(probes, shapes, layout, s, args):
    """One call per (probe, shape), in order, inside the CUDA profiler's window."""
    from profile_kernels import cudart
    lib = cudart()
    order = []
    for name, patch in probes:
        for tp, nw in shapes:
            with patched(patch):
                _profiled_call(lib, lambda c, *x, tp=tp, nw=nw: compress_prefill(c, s, *x, tile_pools=tp,
                                                                                   num_warps=nw), layout, args)
            order.append(f"{name} {'d' if tp is None else tp}x{nw}")
    print("profiled, in order:", "; ".join(order))


def profile_decode(probes, rng, batches, next_ns):
    """decode_update, one call per (probe, batch, next_n), each inside the CUDA profiler's
    window after a warm-up call outside it (for ncu --profile-from-start off)."""
    from pallas_kernels.writes.decode_update import decode_update
    from profile_kernels import cudart
    lib = cudart()
    order = []
    for name, patch in probes:
        for batch in batches:
            for nn in next_ns:
                layout, _, args = bw.decode_case(rng, batch, nn)
                s = layout.strides(0)
                with patched(patch):
                    _profiled_call(lib, lambda c, *x: decode_update(c, s, *x), layout, args)
                order.append(f"{name} B={batch} next_n={nn}")
    print("profiled, in order:", "; ".join(order))


def _shape(text):
    """'4x4' -> (4, 4); 'dx4' -> (None, 4): the default tile (pool_compress.default_tile_pools)."""
    tile, warps = text.split("x")
    return (None if tile == "d" else int(tile)), int(warps)


def compress(probes, shapes, rng, token_counts, quick, calls=30):
    span_us = _tracer(quick, calls)
    copy_bytes = (1 << 22) if quick else tw.COPY_BYTES
    copy_Bps = 2 * copy_bytes / (span_us(lambda x: x + jnp.uint32(1), jnp.zeros((copy_bytes // 4,), jnp.uint32))
                                * 1e-6)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"copy bandwidth {copy_Bps / 1e12:.3f} TB/s (device span of a {copy_bytes >> 20} MiB copy)")
    hdr = f"{'probe':<24}{'tokens':>8}{'tile x warps':>13}{'span us':>10}{'x copy BW':>11}{'saves':>8}  note"
    print(hdr + "\n" + "-" * len(hdr), flush=True)
    for total_tokens in token_counts:
        layout, sc, pre = bw.prefill_case(rng, total_tokens, 4 if quick else 64)
        s = layout.strides(0)
        args = (jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]), jnp.asarray(sc.ape),
                jnp.asarray(pre["slot_mapping"]))
        tokens = int(args[0].shape[0])
        nbytes = bw.compress_bytes(tokens, int((pre["slot_mapping"] >= 0).sum()))
        want = np.asarray(ops.compress_prefill(layout.allocate(0x5A), layout, 0, *args, implementation="xla"))
        base = {}
        for name, patch in probes:
            for tp, nw in shapes:
                with patched(patch):
                    step = lambda c, *x, tp=tp, nw=nw: compress_prefill(c, s, *x, tile_pools=tp, num_warps=nw)
                    note = _check(name, step(layout.allocate(0x5A), *args), want)
                    us = span_us(step, layout.allocate(0), *args)
                shape = f"{'d' if tp is None else tp}x{nw}"
                if name == "exact" and shape not in base:
                    base[shape] = us
                saves = f"{1 - us / base[shape]:>8.0%}" if shape in base else f"{'-':>8}"
                frac = nbytes / (us * 1e-6) / copy_Bps
                print(f"{name:<24}{tokens:>8}{shape:>13}{us:>10.2f}{frac:>11.3f}{saves}  {note}", flush=True)
    print("\nx copy BW: (bytes moved / span) / copy bandwidth of this run; saves: 1 - probe / exact at "
          "the same launch shape ('-' before the first exact row). Only 'exact' is the shipped kernel; "
          "the other SAME_BITS probes are candidates with its bytes.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--shapes", default="dx4",
                    help="tile_pools x num_warps list; d = the default tile (default_tile_pools)")
    ap.add_argument("--calls", type=int, default=30, help="traced calls per row")
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--profile", action="store_true",
                    help="run each probe once between cudaProfilerStart/Stop (for ncu --profile-from-start off)")
    ap.add_argument("--probes", default=",".join(PROBES), help="comma-separated probe names")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the probe list this many times in turn (same-run spread of each row)")
    ap.add_argument("--batches", type=int, nargs="*", default=[256, 1], help="decode batch sizes")
    ap.add_argument("--next-n", type=int, nargs="*", default=[1, 4],
                    help="decode next_n values (--decode)")
    ap.add_argument("--decode", action="store_true",
                    help="time decode_update (B = 256 and 1, next_n 1 and 4, device spans) instead")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    shapes = [_shape(x) for x in a.shapes.split(",")]
    probes = [(k, PROBES[k]) for k in a.probes.split(",")] * a.repeat
    if a.decode and a.profile:
        return profile_decode(probes, rng, a.batches, a.next_n)
    if a.decode:
        return decode(probes, rng, a.quick, a.calls, tuple(a.batches), tuple(a.next_n))
    if a.profile:
        layout, sc, pre = bw.prefill_case(rng, a.tokens[0], 64)
        args = (jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]), jnp.asarray(sc.ape),
                jnp.asarray(pre["slot_mapping"]))
        return profile(probes, shapes, layout, layout.strides(0), args)
    return compress(probes, shapes[:1] if a.quick else shapes, rng, [512] if a.quick else a.tokens, a.quick, a.calls)


if __name__ == "__main__":
    main()
