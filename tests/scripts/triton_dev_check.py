"""Check of the Triton kernels WITHOUT a GPU (interpret: tests/test_triton_interpret.py in CI).

Needs the `triton` package (3.6.0), which the `[test]` extra installs on Linux (x86_64, aarch64)
(the commands below use a throwaway venv beside an environment without it:
    python3 -m venv --system-site-packages /tmp/tlvenv && /tmp/tlvenv/bin/pip install triton==3.6.0 absl-py).
No torch: a small numpy-backed stand-in gives Triton's interpreter the pointers.

    PYTHONPATH=$PWD /tmp/tlvenv/bin/python tests/scripts/triton_dev_check.py interpret [--seed N] [--only G,..]
        Runs the kernels with TRITON_INTERPRET=1 on CPU (numpy) and compares bytes
        with glm5_jax.reference: the numerics helpers on random and edge values, the
        write-kernel cases of tests/write_cases.py, out-of-range slots, the padded
        stride regression, the vLLM vectors when present, the prefill row top-k's
        ids against the reference's top-k (check_row_topk), the tensor-core logits
        and their group maxima against the exact logits (check_prefill_logits), the
        decode split top-k's and the sampled top-k's ids (check_split_and_dense_topk),
        and ops.select_tokens(implementation="triton") whole, prefill rows in windows
        and decode rows, against the golden selection (check_select_tokens).
        --only runs some of the groups: writes, row-topk, logits-split-topk, select-tokens.
    PYTHONPATH=$PWD /tmp/tlvenv/bin/python tests/scripts/triton_dev_check.py compile
        Compiles every kernel for sm_90 through jax_triton 0.3.1's own compile path
        (TTIR -> TTGIR -> LLIR -> PTX) and then ptxas (bundled with triton), and checks
        the word addressing is 64-bit. Needs the jax_triton wheel in .whl/.
    PYTHONPATH=$PWD /tmp/tlvenv/bin/python tests/scripts/triton_dev_check.py sass [--save DIR]
        The read path's top-k launches, exactly as the ops make them at one shape each
        (run_read intercepted under jax.eval_shape: the row top-k of a prefill chunk, the
        dense top-k, the decode split top-k), compiled the same way and
        disassembled (nvdisasm, bundled with triton): per kernel the registers, spills,
        shared memory, SASS instructions, barriers and shared-memory accesses, and per
        loop of more than 60 instructions the same counts. Barriers and shared-memory
        round trips inside a loop are layout conversions or block-wide reductions, the
        costs a profile of these kernels shows; this compares kernel variants on a
        machine without a GPU. --save DIR keeps each kernel's PTX and SASS.

The interpreter runs programs one after another, so it cannot show races between
programs or missing barriers; the GPU tests (tests/test_triton.py) do.
"""
from __future__ import annotations

import contextlib
import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "interpret"
if MODE == "interpret":
    os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported

import pathlib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


# ---------------------------------------------------------------------------------
# interpreter
# ---------------------------------------------------------------------------------
class HostArray:
    """A numpy array dressed as the torch tensor Triton's interpreter expects: it
    only needs data_ptr/dtype and a few storage methods; the interpreter reads and
    writes through the raw pointer, so the numpy memory is updated in place."""

    def __init__(self, a: np.ndarray):
        self.a = np.ascontiguousarray(a)
        self.dtype = str(self.a.dtype)            # "bfloat16", "uint32", ... (Triton maps the name)

    def data_ptr(self):
        return self.a.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *a, **k):
        return self

    def set_(self, *a, **k):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.a.shape

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def copy_(self, other):
        pass                                      # already in place


def _patch_interpreter_index():
    """Triton 3.6's interpreter turns a scalar tensor into an int with int(ndarray of
    shape [1]), which numpy >= 2.x rejects; a loop like ``range(N)`` over a runtime
    scalar then fails in the interpreter only (the compiler takes it). Patch that one
    conversion for this process."""
    import triton.runtime.interpreter as ti
    orig = ti._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    ti._patch_lang_tensor = patched


def _patch_interpreter_unsigned_ones():
    """Triton 3.6's interpreter builds the all-ones operand of ``~x`` as np.full(1, -1,
    dtype), which numpy >= 2.x refuses for unsigned dtypes (the top-k's uint32 order
    keys); build it from the dtype's largest value instead."""
    import triton.runtime.interpreter as ti
    orig = ti.InterpreterBuilder.get_all_ones_value

    def patched(self, type):
        np_type = ti._get_np_dtype(type)
        if np.issubdtype(np_type, np.unsignedinteger):
            return ti.TensorHandle(np.full(1, np.iinfo(np_type).max, dtype=np_type), type.scalar)
        return orig(self, type)
    ti.InterpreterBuilder.get_all_ones_value = patched


def _patch_interpreter_fp8():
    """Triton 3.6's interpreter converts to fp8 by cutting the significand and adding the
    first cut bit, which loses the carry into the exponent (126.3 -> 64, 0.0309 ->
    0.0156) and rounds ties up rather than to even. Conversions to and from e4m3
    (``tl.float8e4nv``) go through ml_dtypes instead, saturating like the GPU's
    cvt.rn.satfinite; other types keep the interpreter's own conversion."""
    import ml_dtypes
    import triton.language as tl
    import triton.runtime.interpreter as ti
    orig = ti.InterpreterBuilder.create_fp_to_fp
    e4m3 = ml_dtypes.float8_e4m3fn
    wide = {tl.float32: np.float32, tl.float16: np.float16, tl.bfloat16: ml_dtypes.bfloat16}

    def patched(self, src, dst_type, rounding_mode):
        src_t, dst_t = src.dtype.scalar, dst_type.scalar
        if dst_t == tl.float8e4nv and src_t in wide:
            v = src.data.view(wide[src_t]).astype(np.float32)
            v = np.where(np.isnan(v), v, np.clip(v, -448.0, 448.0))
            return ti.TensorHandle(v.astype(e4m3).view(np.uint8), dst_t)
        if src_t == tl.float8e4nv and dst_t in wide:
            v = src.data.view(e4m3).astype(wide[dst_t])
            return ti.TensorHandle(v.view(ti._get_np_dtype(dst_type)), dst_t)
        return orig(self, src, dst_type, rounding_mode)
    ti.InterpreterBuilder.create_fp_to_fp = patched


if MODE == "interpret":
    _patch_interpreter_index()
    _patch_interpreter_unsigned_ones()
    _patch_interpreter_fp8()


def interpret(launch):
    """Run a _call.Launch with the interpreter; returns the new cache (a jax array)."""
    if launch is None:
        return None
    hosts = [HostArray(np.array(a)) for a in launch.arrays]
    cache = hosts[launch.cache_index]
    launch.kernel[launch.grid](*launch.scalars, *hosts, cache, **launch.constexprs)
    return jnp.asarray(cache.a)


def interp_writers():
    from pallas_kernels.triton_lang import decode_update as du, pool_compress as pc, tail_seed as ts

    def keep(c, new):
        return c if new is None else new
    return dict(
        compress=lambda c, lay, l, k, g, a, s: keep(c, interpret(pc.plan(c, lay.strides(l), k, g, a, s))),
        seed=lambda c, lay, l, k, g, t: keep(c, interpret(ts.plan(c, lay.strides(l), k, g, t))),
        decode=lambda c, lay, l, k, g, a, s, t, p: keep(c, interpret(du.plan(c, lay.strides(l), k, g, a, s, t, p))),
    )


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pallas_kernels.triton_lang import numerics_tl as N  # noqa: E402


@triton.jit
def _unary_kernel(x_ptr, o_ptr, tab_ptr, OP: tl.constexpr, M: tl.constexpr):
    idx = tl.arange(0, M)[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + idx)
    if OP == 0:
        y = N.exp_f32(x, tab_ptr)                  # tab_ptr: numerics.EXP_TABLE
    elif OP == 1:
        y = N.recip_f32(x)
    elif OP == 2:
        y = N.round_bf16(x)
    elif OP == 3:
        y = N.e4m3_code(x).to(tl.float32, bitcast=True)
    elif OP == 4:
        y = N.hadamard128(x, M)
    elif OP == 5:
        y = N.mac(x, x * 1.5, x * -0.75)
    else:
        y = N.round_bf16(N.hadamard128(x, M) * N.INV_SQRT_128)
    tl.store(o_ptr + idx, y)


@triton.jit
def _quant_kernel(x_ptr, w_ptr, s_ptr, M: tl.constexpr):
    idx = tl.arange(0, M)[:, None] * 128 + tl.arange(0, 128)[None, :]
    words, scale = N.rotate_quant_words(tl.load(x_ptr + idx), tl.zeros([M, 128], tl.int32), M)
    tl.store(w_ptr + tl.arange(0, M)[:, None] * 32 + tl.arange(0, 32)[None, :], words)
    tl.store(s_ptr + tl.arange(0, M), scale)


def check_numerics(rng):
    """Each numerics_tl helper against numerics.py on random values spread over
    decades plus edge values (signed zeros, subnormals, fp8 ties, +-448 / 464)."""
    from pallas_kernels.core import numerics as nm
    unary, quant = _unary_kernel, _quant_kernel

    m = 64
    mag = np.exp(rng.uniform(np.log(1e-6), np.log(1e4), (m, 1)))
    x = (rng.standard_normal((m, 128)) * mag).astype(np.float32)
    edge = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, 448.0, 464.0, -464.0, 0.0009765625, 0.001953125,
                     0.0029296875, 2.0 ** -10 * 1.5, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.0, 240.0], np.float32)
    x[0, :edge.size] = edge
    x[1] = -0.0                                      # all signed zeros (hadamard: +0 out, like XLA)
    x[2] = 0.0
    x[2, ::3] = -0.0
    jit = {k: jax.jit(f) for k, f in dict(
        exp=nm.exp_f32, recip=nm.recip_f32, bf16=nm.round_bf16,
        e4m3=lambda v: nm.e4m3_bits(jnp.clip(v, -448.0, 448.0)).astype(jnp.uint32),
        had=nm.hadamard128, mac=lambda v: nm.mac(v, v * 1.5, v * -0.75),
        rot=lambda v: nm.round_bf16(nm.hadamard128(v) * nm.INV_SQRT_128)).items()}
    pos = np.abs(x) + np.float32(1e-30)
    # XLA on CPU flushes subnormals to zero (the interpreter and both GPU compilers keep
    # them), so mac, whose partial products of subnormal inputs are subnormal, gets normal inputs
    normal = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)
    cases = [("exp", 0, np.clip(x, -100, 100)), ("recip", 1, pos), ("bf16", 2, x),
             ("e4m3", 3, np.clip(x, -448, 448)), ("had", 4, x), ("mac", 5, normal), ("rot", 6, x)]
    bad = 0
    for name, op, v in cases:
        out = np.zeros((m, 128), np.float32)
        unary[(1,)](HostArray(v), HostArray(out), HostArray(nm.EXP_TABLE.copy()), OP=op, M=m)
        want = np.asarray(jit[name](jnp.asarray(v))).astype(np.uint32 if name == "e4m3" else np.float32)
        got = out.view(np.uint32) if name == "e4m3" else out
        n = int((got.view(np.uint32) != want.view(np.uint32)).sum())
        print(f"  numerics {name:6s}: {n} of {got.size} words differ")
        bad += n
    xb = nm.round_bf16(jnp.asarray(x))
    words, scale = np.zeros((m, 32), np.uint32), np.zeros(m, np.float32)
    quant[(1,)](HostArray(np.asarray(xb)), HostArray(words), HostArray(scale), M=m)
    q8, s = jax.jit(nm.rotate_quant)(xb)
    n = int((words != np.asarray(nm.pack_fp8_words(q8))).sum()
            + (scale.view(np.uint32) != np.asarray(s).view(np.uint32)).sum())
    print(f"  numerics rotate_quant_words: {n} words differ")
    return bad + n


def check_cases(rng):
    import write_cases as W
    bad = 0
    for p in W.CASES:
        cfg, lay = p.values
        layout, sc, pre, steps, upto = W.random_workload(rng, cfg, lay)
        ref_cache, ref_snaps = W.run_writes(W.ops_writers("xla"), layout, lay["layer"], sc, pre, steps)
        _, got = W.run_writes(interp_writers(), layout, lay["layer"], sc, pre, steps)
        diffs = [int((a != b).sum()) for a, b in zip(ref_snaps, got)]
        changed = int((ref_snaps[-1] != W.SENTINEL).sum())
        print(f"  case {p.id:30s}: bytes differing per stage {diffs} ({changed} bytes written)")
        sc.check_cache(ref_cache, upto, W.SENTINEL)
        bad += sum(diffs)
    return bad


def check_out_of_range(rng):
    """Slots past the last block and padding write nothing (as tests/test_gpu.py)."""
    from glm5_jax.config import IndexerConfig
    from glm5_jax.layout import CacheLayout
    w = interp_writers()
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=8)
    t = 64
    key = jnp.asarray(rng.standard_normal((t, 128)), jnp.bfloat16)
    slot = jnp.asarray(np.resize(np.array([8 * 288, 10**6, 2**31 - 1, -1, -5], np.int32), t))
    tslot = jnp.asarray(np.resize(np.array([8 * 4, 8 * 4 + 3, 10**7, -1], np.int32), t))
    pos = jnp.asarray(np.resize(np.array([3, 7, 11, -1], np.int32), (16, 4)))
    c = w["compress"](layout.allocate(0x33), layout, 0, key, key, jnp.zeros((4, 128), jnp.float32), slot)
    c = w["seed"](c, layout, 0, key, key, tslot)
    c = w["decode"](c, layout, 0, key.reshape(16, 4, 128), key.reshape(16, 4, 128), jnp.zeros((4, 128), jnp.float32),
                    slot.reshape(16, 4), tslot.reshape(16, 4), pos)
    n = int(jnp.sum(c != jnp.uint32(0x33333333)))
    print(f"  out-of-range slots: {n} words written (want 0)")
    return n


def check_padded_stride(rng):
    import write_cases as W
    from pallas_kernels.triton_lang import tail_seed as ts
    for fault in (None, "dense-tail-stride"):
        W.check_padded_stride(rng, lambda c, s, k, g, t: interpret(ts.plan(c, s, k, g, t)), fault)
        print(f"  padded stride regression (fault={fault}): ok")
    return 0


def check_launch_variants(rng):
    """seed_tail's request_ends_tokens mode and other tiles / warp counts (as tests/test_triton.py)."""
    import write_cases as W
    from glm5_jax import reference as ref
    from pallas_kernels.triton_lang import pool_compress as pc, tail_seed as ts
    bad = 0
    for kpool in (4, 16):
        layout, layer, args, ends = W.request_ends_case(rng, kpool)
        s = layout.strides(layer)
        want = W.as_bytes(ref.seed_tail_strides(layout.allocate(W.SENTINEL), s, *args))
        got = W.as_bytes(interpret(ts.plan(layout.allocate(W.SENTINEL), s, *args, ends)))
        n = int((want != got).sum())
        print(f"  seed request_ends_tokens kpool={kpool}: {n} bytes differ ({int((want != W.SENTINEL).sum())} written)")
        bad += n
    layout, key, gate, ape, slot = W.tile_case(rng)
    s = layout.strides(0)
    want = W.as_bytes(ref.compress_prefill_strides(layout.allocate(W.SENTINEL), s, key, gate, ape, slot))
    for tile in (1, 16):
        got = W.as_bytes(interpret(pc.plan(layout.allocate(W.SENTINEL), s, key, gate, ape, slot, tile_pools=tile)))
        n = int((want != got).sum())
        print(f"  compress tile_pools={tile}: {n} bytes differ")
        bad += n
    return bad


def check_vectors(rng=None):                      # rng unused: the recorded vectors are fixed inputs
    import vectors as V
    if not V.available():
        print("  vLLM vectors: not found, skipped")
        return 0
    w = interp_writers()
    layout, sent, key, gate, tslot, want = V.seed_case()
    c = w["seed"](layout.allocate(sent), layout, 0, jnp.asarray(key), jnp.asarray(gate), jnp.asarray(tslot))
    n1 = int((V.cache_bytes(c, want.size) != want).sum())
    layout, key, gate, ape, slot, want = V.compress_case()
    c = w["compress"](layout.allocate(0), layout, 0, jnp.asarray(key), jnp.asarray(gate), jnp.asarray(ape),
                      jnp.asarray(slot))
    n2 = int((V.cache_bytes(c, want.size) != want).sum())
    print(f"  vLLM vectors: seed {n1} bytes differ, compress {n2} bytes differ")
    return n1 + n2


# ---------------------------------------------------------------------------------
# compile for sm_90 (no GPU needed) through jax_triton's own compile path
# ---------------------------------------------------------------------------------
def _load_jax_triton_lib():
    """jax_triton/triton_lib.py without its package __init__ (which refuses a CPU jaxlib)."""
    import glob
    import importlib.util
    import tempfile
    import zipfile
    whl = sorted(glob.glob(str(ROOT / ".whl" / "jax_triton-*.whl")))
    if not whl:
        raise SystemExit("no jax_triton wheel in .whl/")
    d = tempfile.mkdtemp()
    zipfile.ZipFile(whl[-1]).extractall(d)
    spec = importlib.util.spec_from_file_location("jt_triton_lib", f"{d}/jax_triton/triton_lib.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                  # dataclasses look the module up while it loads
    spec.loader.exec_module(mod)
    return mod


def _interpret_read(kernel, scalars, arrays, out_shape, *, grid, constexprs, input_output_aliases=None, **_):
    """_call.run_read in the interpreter, for concrete arrays (under jax.disable_jit):
    the outputs start filled with a sentinel, so a slot the kernel leaves shows, but
    for an output aliased to an input (``input_output_aliases``), which starts as a
    copy of that input. The two stay separate arrays here (one buffer on the GPU): a
    kernel reading back through the input what it wrote to the output would differ.
    Traced inputs (a caller's ``jax.eval_shape``) get zeros of the outputs' shapes."""
    outs = out_shape if isinstance(out_shape, tuple) else (out_shape,)
    if any(isinstance(a, jax.core.Tracer) for a in arrays):     # traced for its shapes (jax.eval_shape)
        got = tuple(jnp.zeros(o.shape, o.dtype) for o in outs)
        return got if isinstance(out_shape, tuple) else got[0]
    hosts = [HostArray(np.full(o.shape, 0xA5A5A5A5 if o.dtype == jnp.uint32 else -7, o.dtype)) for o in outs]
    for i, j in (input_output_aliases or {}).items():
        hosts[j] = HostArray(np.array(arrays[i], dtype=outs[j].dtype).reshape(outs[j].shape))
    kernel[grid](*scalars, *[HostArray(np.asarray(a)) for a in arrays], *hosts, **constexprs)
    got = tuple(jnp.asarray(h.a) for h in hosts)
    return got if isinstance(out_shape, tuple) else got[0]


@contextlib.contextmanager
def _reads_in_interpreter():
    """_call.run_read served by _interpret_read inside the block."""
    from pallas_kernels.triton_lang import _call
    saved = _call.run_read
    _call.run_read = _interpret_read
    try:
        yield
    finally:
        _call.run_read = saved


def _report_ids(label, got, want) -> int:
    """Print whether [rows, k] ids equal the reference's (naming the rows that differ); 1 if not."""
    ok = np.array_equal(got, want)
    print(f"  {label}: {'ok' if ok else 'DIFFERS in rows ' + str(np.where((got != want).any(1))[0].tolist())}")
    return int(not ok)


def check_row_topk(rng):
    """The prefill row top-k (``topk_rows.topk_pools``, its planning and launches, the
    kernels in the interpreter) against glm5_jax.reference.topk_pools: rows of random
    scores, a ReLU plateau of zeros of both signs (equal in the order) and heavy ties,
    lengths from 0 to the row, with group maxima (the floor from registers and from histograms) and without (the
    register form and the walks, merged by row length), by score and (but for the
    histogram floor) by pool id against ``reference.pool_order``. The interpreter checks the
    kernel's logic, not the GPU's layouts or races."""
    from glm5_jax import reference as ref
    from pallas_kernels.triton_lang import topk_rows as tr
    from test_tc_read import group_maxima
    tunes = [("default", tr.DEFAULT, True),
             ("histogram floor, 256 a step", tr.Tuning(reg_pools=0, block=256, floor_maxima=0), True),
             ("no maxima, register form", tr.WHOLE_ROW, False)]
    bad = 0
    with _reads_in_interpreter():
        for case in range(6):
            rows, n, k = 5, int(rng.choice([700, 2048, 5000, 8192])), int(rng.choice([16, 64, 128]))
            if case % 3 == 0:
                x = rng.standard_normal((rows, n)).astype(np.float32)
            elif case % 3 == 1:                     # w * relu(s): zeros of both signs
                x = (np.maximum(rng.standard_normal((rows, n)), 0)
                     * rng.choice([-1.0, 1.0], (rows, n))).astype(np.float32)
            else:
                x = rng.integers(-3, 4, (rows, n)).astype(np.float32)
            lengths = rng.integers(0, n + 1, rows).astype(np.int32)
            lengths[0], lengths[1] = n, min(n, k - 3)
            want = np.asarray(ref.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k))
            want_by_pool = np.asarray(ref.pool_order(jnp.asarray(want)))
            for label, tune, with_maxima in tunes:
                for order in ("score", "pool") if tune.floor_maxima else ("score",):
                    with jax.disable_jit():
                        got = np.asarray(tr.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k,
                                                       jnp.asarray(group_maxima(x)) if with_maxima else None,
                                                       tune=tune, order=order))
                    bad += _report_ids(f"row top-k {rows} x {n}, k {k}, {['normal', 'relu', 'ties'][case % 3]}, "
                                       f"{label}, order {order}", got, want if order == "score" else want_by_pool)
    return bad


def _topk_rows(rng, rows, n, k):
    """Scores for the top-k checks: random, ReLU plateau (zeros of both signs), few
    distinct values (ties) and duplicated keys in turn, row by row; lengths from 0 to past the row, the first full."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1::4] = np.maximum(x[1::4], 0.0) * rng.choice([-1.0, 1.0], x[1::4].shape)    # zeros of both signs
    x[2::4] = np.round(x[2::4] * 2) / 2
    x[3::4] = np.repeat(x[3::4, ::8], 8, axis=1)[:, :n]
    lengths = rng.integers(0, n + 100, rows).astype(np.int32)
    lengths[0] = n
    lengths[1] = min(n, k - 1)
    return x, lengths


def check_split_and_dense_topk(rng):
    """The decode split top-k (``split_topk.topk_pools_split``: the candidate launch with
    maxima of 8 and of 64 pools, then the rank launch) and the sampled top-k of bare
    scores (``dense_topk``: sample, collect, select launches) against
    glm5_jax.reference.topk_pools, the kernels in the interpreter; aliased outputs (the
    counters) start as their inputs, the others sentinel-filled."""
    from glm5_jax import reference as ref
    from pallas_kernels.triton_lang import dense_topk, split_topk
    from test_tc_read import group_maxima, step_maxima
    bad = 0
    with _reads_in_interpreter():
        for rows, n, k in ((6, 5000, 64), (4, 20000, 512)):
            x, lengths = _topk_rows(rng, rows, n, k)
            want = np.asarray(ref.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k))
            for pools, mx in ((8, group_maxima(x)), (64, step_maxima(x))):
                with jax.disable_jit():
                    got = np.asarray(split_topk.topk_pools_split(jnp.asarray(x), jnp.asarray(lengths), k,
                                                                 jnp.asarray(mx), pools))
                bad += _report_ids(f"split top-k {rows} x {n}, k {k}, maxima of {pools}", got, want)
            with jax.disable_jit():
                xs, ls = jnp.asarray(x), jnp.asarray(lengths)
                guess, count = dense_topk.sample_guesses(xs, ls, k)
                got = np.asarray(dense_topk.select_candidates(
                    xs, ls, dense_topk.collect_candidates(xs, ls, guess, count, k), k))
            bad += _report_ids(f"sampled top-k {rows} x {n}, k {k}", got, want)
    return bad


def check_prefill_logits(rng):
    """The tensor-core logits kernel (``prefill_logits.paged_logits``, its launch shape
    and page entries, the kernel in the interpreter, outputs sentinel-filled) against
    the exact logits of test_tc_read.golden: every element written with ``fill`` (-inf
    exactly outside each row's context), each within the contract's bound E, the
    group maxima equal to those of the kernel's own logits, without ``fill`` the same
    logits and maxima below each row's context, and a window of rows (``first_row``)
    within E of those rows' exact logits, a first row past the last window clamped to
    it, a float first row refused. The interpreter's dot is numpy's,
    not wgmma: this checks the addressing, masks and maxima, not the GPU's rounding."""
    from pallas_kernels.read import workspace
    from pallas_kernels.triton_lang import prefill_logits as pl
    from test_tc_read import golden, group_maxima, tc_case
    bad = 0
    with _reads_in_interpreter():
        for label, case in (("P32-H32", dict(block_size=1152, heads=32)), ("P64-H32", dict(block_size=256, heads=32))):
            layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, b=2, n=21, max_pages=5, **case)
            gold, e = golden(cache, layout, layer, q8, wf, table, ctx)
            args = (jnp.asarray(cache), s, q8, wf, jnp.asarray(table), jnp.asarray(ctx))
            for tname, tune in (("prefill", pl.PREFILL), ("decode", pl.DECODE)):
                with jax.disable_jit():
                    lg, mx = (np.asarray(a) for a in pl.paged_logits(*args, fill=True, maxima=True, tune=tune))
                    lg0, mx0 = (np.asarray(a) for a in pl.paged_logits(*args, fill=False, maxima=True, tune=tune))
                fin = np.isfinite(gold)
                last = np.array([max(workspace.group_columns(g)) for g in range(mx.shape[-1])])
                inside = last < lg.shape[-1]
                want_mx = group_maxima(lg.reshape(-1, lg.shape[-1])).reshape(mx.shape)
                errs = [np.array_equal(np.isneginf(lg), ~fin) and not np.isnan(lg).any(),
                        bool((np.abs(lg[fin] - gold[fin]) <= e[fin]).all()),
                        np.array_equal(mx[..., inside], want_mx[..., inside])]
                seen_ok = True
                for b in range(lg.shape[0]):
                    for i in range(lg.shape[1]):
                        c = int(ctx[b, i])
                        seen_ok &= np.array_equal(lg0[b, i, :c], lg[b, i, :c])
                        seen_ok &= np.array_equal(mx0[b, i, last < c], mx[b, i, last < c])
                errs.append(bool(seen_ok))
                # a window of rows read from the whole queries (first_row), as select_tokens' chunks do
                first, c = 5, 11
                with jax.disable_jit():
                    lgw = np.asarray(pl.paged_logits(args[0], s, q8, wf, args[4], jnp.asarray(ctx[:, first:first + c]),
                                                     fill=True, tune=tune, first_row=jnp.int32(first)))
                gw, ew = gold[:, first:first + c], e[:, first:first + c]
                fw = np.isfinite(gw)
                errs.append(np.array_equal(np.isneginf(lgw), ~fw) and bool((np.abs(lgw[fw] - gw[fw]) <= ew[fw]).all()))
                # a first row past the last window clamps to it, as lax.dynamic_slice clamps; a float one is refused
                n_q = q8.shape[1]
                with jax.disable_jit():
                    lgc = np.asarray(pl.paged_logits(args[0], s, q8, wf, args[4], jnp.asarray(ctx[:, n_q - c:]),
                                                     fill=True, tune=tune, first_row=jnp.int32(n_q - c + 7)))
                gc, ec = gold[:, n_q - c:], e[:, n_q - c:]
                fc = np.isfinite(gc)
                clamped = np.array_equal(np.isneginf(lgc), ~fc) and bool((np.abs(lgc[fc] - gc[fc]) <= ec[fc]).all())
                try:
                    pl.paged_logits(args[0], s, q8, wf, args[4], jnp.asarray(ctx[:, :c]), first_row=1.0)
                    clamped = False
                except ValueError as err:
                    clamped &= "integer scalar" in str(err)
                errs.append(clamped)
                names = ("written, -inf outside the context", "within E", "maxima", "without fill", "a window of rows",
                         "the first row clamped, a float refused")
                failed = [nm for nm, ok in zip(names, errs) if not ok]
                bad += len(failed)
                print(f"  prefill logits {label} {tname}: {'ok' if not failed else 'DIFFERS: ' + ', '.join(failed)}")
    return bad


def check_select_tokens(rng):
    """``ops.select_tokens(implementation="triton")`` whole, its kernels in the interpreter
    (the availability check, which needs a GPU, patched out): prefill rows of one request
    in three overlapping windows (a small ``workspace_bytes``) through the logits kernel
    with its maxima, the row top-k and the expansion, and decode rows (2 per request, one
    request of padding) through the logits kernel with positions and counters and the
    split top-k. On every row the
    contract decides (tests/test_tc_read.py ``decided_rows``) the selected pools equal the
    golden selection; the tail tokens equal the reference's; the windows change no row
    (one window gives the same tokens); order="pool" gives the same tokens in pool order;
    a decode request alone gives the tokens it gets in the batch."""
    from glm5_jax import ops
    from pallas_kernels.core import addressing as addr
    from pallas_kernels.read import workspace
    from pallas_kernels.triton_lang import _call
    from test_tc_read import decided_rows, golden, in_pool_order, np_expand, np_topk, tc_case
    bad = 0
    saved = _call.require
    _call.require = lambda op: None
    try:
        with _reads_in_interpreter(), jax.disable_jit():
            for label, b, n in (("prefill", 1, ops.TC_MIN_ROWS + 9), ("decode", 12, 2)):
                layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, b=b, n=n, max_pages=8)
                c = layout.config
                n_pools = addr.pools_in_pages(s, table.shape[1])
                k = 16                                # rows of 2k .. 16k pools: the floor from the maxima too
                if label == "prefill":
                    pos = np.sort(rng.choice(np.arange(2 * k * c.kpool, n_pools * c.kpool), n,
                                             replace=False)).astype(np.int32)[None, :]
                else:
                    last = rng.integers(n + 2 * k * c.kpool, n_pools * c.kpool, b)
                    pos = (last[:, None] - np.arange(n)[::-1][None, :]).astype(np.int32)
                    pos[-1] = -1                                              # a padding request

                def select(rows=slice(None), **kw):
                    return np.asarray(ops.select_tokens(
                        jnp.asarray(cache), layout, layer, q8[rows], wf[rows], jnp.asarray(table[rows]),
                        jnp.asarray(pos[rows]), topk_tokens=k * c.kpool, short_context=False,
                        implementation="triton", **kw))
                # three windows of rows, the last two overlapping
                ws_bytes = workspace.chunk_row_bytes(n_pools, k) * b * (n // 3 + 1)
                got = select(workspace_bytes=ws_bytes) if label == "prefill" else select()
                checks = {}
                if label == "prefill":
                    assert workspace.rows_per_chunk(n, n_pools, k, workspace_bytes=ws_bytes) < n
                    checks["one window, the same tokens"] = np.array_equal(select(), got)
                else:
                    checks["a request alone, the same tokens"] = np.array_equal(select(slice(1, 2)), got[n:2 * n])
                by_pool = select(order="pool", **({"workspace_bytes": ws_bytes} if label == "prefill" else {}))
                checks["order pool"] = (np.array_equal(by_pool, in_pool_order(got, k * c.kpool))
                                        and bool((by_pool != got).any()))         # the score order is another
                seq = np.where(pos >= 0, pos + 1, 0)
                gold, e = golden(cache, layout, layer, q8, wf, table, seq // c.kpool)
                gold, e = gold.reshape(b * n, -1), e.reshape(b * n, -1)
                ctx, seq = (seq // c.kpool).reshape(-1), seq.reshape(-1)
                decided = decided_rows(gold, e, ctx, k)
                want = np_expand(np_topk(gold, ctx, k), seq, c.kpool)
                def sel(x):                                   # each row's selected pools, sorted
                    return np.sort(x[:, :k * c.kpool].reshape(x.shape[0], k, c.kpool)[..., 0], axis=1)
                checks[f"selected sets ({decided.size} of {b * n} rows decided)"] = (
                    decided.size >= 0.2 * b * n and np.array_equal(sel(got[decided]), sel(want[decided])))
                checks["tail tokens"] = np.array_equal(got[:, k * c.kpool:], want[:, k * c.kpool:])
                failed = [name for name, ok in checks.items() if not ok]
                bad += len(failed)
                print(f"  select_tokens triton {label} {b} x {n}: "
                      f"{'ok (' + ', '.join(checks) + ')' if not failed else 'DIFFERS: ' + ', '.join(failed)}")
    finally:
        _call.require = saved
    return bad


def check_compile():
    import re
    import subprocess
    import tempfile
    import triton
    from glm5_jax.config import IndexerConfig
    from glm5_jax.layout import CacheLayout
    from glm5_jax.testing import Scenario
    from pallas_kernels.triton_lang import decode_update as du, pool_compress as pc, tail_seed as ts
    jtl = _load_jax_triton_lib()
    jtl.triton_kernel_call_lib = type("Fake", (), {"TritonKernel": staticmethod(lambda *a: a)})
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    rng = np.random.default_rng(0)
    bad = 0
    for kpool, spec in ((4, 1), (16, 0)):
        layout = CacheLayout(IndexerConfig(kpool=kpool, num_spec_tokens=spec, block_size=kpool * 288),
                             num_layers=1, num_blocks=16)
        sc = Scenario.random(rng, layout, [5 * kpool + 3, 2 * kpool])
        pre = sc.prefill([4 * kpool + 1, kpool])
        st = sc.decode([4 * kpool + 1, kpool], [3, 2], 4)
        a = {k: jnp.asarray(v) for k, v in pre.items()}
        d = {k: jnp.asarray(v) for k, v in st.items()}
        s, cache, ape = layout.strides(0), layout.allocate(0), jnp.asarray(sc.ape)
        launches = [ts.plan(cache, s, a["key"], a["gate"], a["tslot"]),
                    pc.plan(cache, s, a["key"], a["gate"], ape, a["slot_mapping"]),
                    du.plan(cache, s, d["key"], d["gate"], ape, d["slot_mapping"], d["tslot"], d["positions"])]
        if kpool == 4:                             # the launch shapes of test_triton_launch_shapes
            ends = jnp.asarray([4 * kpool + 1, 5 * kpool + 1], jnp.int32)
            launches += [ts.plan(cache, s, a["key"], a["gate"], a["tslot"], ends, tile_tokens=1, num_warps=1),
                         ts.plan(cache, s, a["key"], a["gate"], a["tslot"], tile_tokens=16, num_warps=8),
                         pc.plan(cache, s, a["key"], a["gate"], ape, a["slot_mapping"], tile_pools=1, num_warps=1),
                         pc.plan(cache, s, a["key"], a["gate"], ape, a["slot_mapping"], tile_pools=16, num_warps=8),
                         du.plan(cache, s, d["key"], d["gate"], ape, d["slot_mapping"], d["tslot"], d["positions"],
                                 num_warps=8)]
        for launch in launches:
            # the argument list jax_triton builds: scalars, array inputs, then the output
            avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in launch.arrays]
            scalars = [(i, jtl.get_triton_type(v), v) for i, v in enumerate(launch.scalars)]
            arg_dtypes = ([t for _, t, _ in scalars] + [jtl.get_triton_type(x) for x in avals]
                          + [jtl.get_triton_type(avals[launch.cache_index])])
            kern, _ = jtl.get_or_create_triton_kernel(
                jtl.get_cuda_backend, "cuda", launch.kernel, arg_dtypes, scalars, num_warps=launch.num_warps,
                num_stages=1, num_ctas=1, compute_capability=90, enable_fp_fusion=True,
                metaparams=launch.constexprs, dump=False)
            name, _, _, shared, ptx, ttir, _ = kern
            with tempfile.TemporaryDirectory() as tmp:
                open(f"{tmp}/k.ptx", "w").write(ptx)
                r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                   capture_output=True, text=True)
            regs = re.findall(r"Used (\d+) registers", r.stderr)
            spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
            i64 = "i64" in ttir and re.search(r"arith\.muli .*: tensor<.*xi64", ttir) is not None
            ok = r.returncode == 0 and i64
            bad += not ok
            tile = launch.constexprs.get("TILE", "-")
            print(f"  R={kpool:2d} {launch.name:30s} tile={tile!s:3s} ptxas rc={r.returncode} regs={regs} "
                  f"spill stores={spills}B shared={shared}B 64-bit word index={i64} grid={launch.grid} "
                  f"warps={launch.num_warps}")
            if r.returncode:
                print(r.stderr[-2000:])
    return bad


def read_launches():
    """(label, captured run_read call) of the top-k launches and the prefill logits
    launch the ops make at one shape each: run_read is replaced by a recorder that
    returns zeros of the output shapes, and the jitted wrappers are traced with
    jax.eval_shape (nothing runs)."""
    from pallas_kernels.read import workspace
    from pallas_kernels.triton_lang import _call, dense_topk, split_topk, topk_rows
    recorded = []

    def record(kernel, scalars, arrays, out_shape, **kw):
        recorded.append(dict(kernel=kernel, scalars=scalars, arrays=[a.aval for a in arrays],
                             outs=list(out_shape) if isinstance(out_shape, tuple) else [out_shape], **kw))
        return tuple(jnp.zeros(o.shape, o.dtype) for o in out_shape) if isinstance(out_shape, tuple) \
            else jnp.zeros(out_shape.shape, out_shape.dtype)

    def f32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    def u32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.uint32)

    k = 512
    rows, n = 11070, 8192                         # a 32k prefill's last chunk
    cases = [
        ("row top-k, prefill chunk", lambda: topk_rows.topk_pools(
            f32(rows, n), i32(rows), k, u32(rows, workspace.maxima_cols(n)))),
        ("row top-k, prefill chunk, by pool id", lambda: topk_rows.topk_pools(
            f32(rows, n), i32(rows), k, u32(rows, workspace.maxima_cols(n)), order="pool")),
        ("row top-k, register form by pool id", lambda: topk_rows.topk_pools(
            f32(rows, 4096), i32(rows), k, tune=topk_rows.Tuning(reg_pools=4096), order="pool")),
        ("dense top-k [64, 131072]", lambda: dense_topk.topk_pools(f32(64, 131072), i32(64), k)),
        ("decode split top-k [1, 8192]", lambda: split_topk.select_tokens_split(       # B = 1 x 32k tokens
            f32(1, 8192), i32(1), k, u32(1, workspace.maxima_cols(8192)), workspace.MAXIMA_GROUP_POOLS, 4,
            i32(1))),
    ]
    from glm5_jax.config import IndexerConfig
    from glm5_jax.layout import CacheLayout
    from pallas_kernels.triton_lang import prefill_logits
    layout = CacheLayout(IndexerConfig(block_size=1152), num_layers=1, num_blocks=64)
    st, tokens, pages = layout.strides(0), 32768, 256                # 256 pages x 32 rows: 8,192 pools
    window_rows = -(-tokens // -(-tokens // rows))                    # 3 windows of 10,923 rows
    cases.append(("prefill logits, a 32k prefill's window of rows", lambda: prefill_logits.paged_logits(
        u32(layout.total_words), st, jax.ShapeDtypeStruct((1, tokens, 32, 128), jnp.float8_e4m3fn),
        f32(1, tokens, 32), i32(1, pages), i32(1, window_rows), fill=False, maxima=True,
        tune=prefill_logits.PREFILL, first_row=i32())))
    saved = _call.run_read
    _call.run_read = record
    try:
        out = []
        for label, f in cases:
            recorded.clear()
            jax.eval_shape(f)
            if not recorded:
                raise SystemExit(f"{label}: no launch recorded (run_read not called through _call)")
            out += [(f"{label}: {r['name']} #{i}", r) for i, r in enumerate(recorded)]
        return out
    finally:
        _call.run_read = saved


def sass_loops(sass: str, least: int = 60):
    """(instructions, loops) of nvdisasm text: every instruction, and per loop of more
    than `least` instructions (a backward branch to a label .L_x_N) (first, last,
    instructions, barriers, shared accesses)."""
    import re
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lm = re.match(r"^(\.L_x_\d+):", line.strip())
        if lm:
            pending.append(lm.group(1))
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            labels.update({p: len(ins) for p in pending})
            pending = []
            ins.append(m.group(1).strip())
    ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split(" ")[0] for x in ins]      # the opcode, predicate dropped
    loops = []
    for i, t in enumerate(ins):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)
        if m and labels.get(m.group(1), i + 1) <= i and i + 1 - labels[m.group(1)] > least:
            body = ops[labels[m.group(1)]:i + 1]
            loops.append((labels[m.group(1)], i, len(body), sum(o.startswith("BAR.SYNC") for o in body),
                          sum(o.startswith(("STS", "LDS")) for o in body)))
    return ins, loops


def check_sass():
    import re
    import subprocess
    import tempfile
    import triton
    save = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv else None
    jtl = _load_jax_triton_lib()
    jtl.triton_kernel_call_lib = type("Fake", (), {"TritonKernel": staticmethod(lambda *a: a)})
    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    bad = 0
    for label, r in read_launches():
        scalars = [(i, jtl.get_triton_type(v), v) for i, v in enumerate(r["scalars"])]
        arg_dtypes = ([t for _, t, _ in scalars]
                      + [jtl.get_triton_type(jax.core.ShapedArray(a.shape, a.dtype)) for a in r["arrays"] + r["outs"]])
        kern, _ = jtl.get_or_create_triton_kernel(
            jtl.get_cuda_backend, "cuda", r["kernel"], arg_dtypes, scalars, num_warps=r["num_warps"],
            num_stages=r["num_stages"], num_ctas=1, compute_capability=90, enable_fp_fusion=True,
            metaparams=r["constexprs"], dump=False)
        name, _, _, shared, ptx, _, _ = kern
        with tempfile.TemporaryDirectory() as tmp:
            open(f"{tmp}/k.ptx", "w").write(ptx)
            asm = subprocess.run([str(tools / "ptxas"), "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                 capture_output=True, text=True)
            sass = subprocess.run([str(tools / "nvdisasm"), "-c", f"{tmp}/k.cubin"], capture_output=True,
                                  text=True).stdout if asm.returncode == 0 else ""
        if save:
            os.makedirs(save, exist_ok=True)
            stem = os.path.join(save, label.split(": ", 1)[1].replace(" #", "_"))
            open(stem + ".ptx", "w").write(ptx)
            open(stem + ".sass", "w").write(sass)
        regs = ",".join(re.findall(r"Used (\d+) registers", asm.stderr)) or "?"
        spills = ",".join(re.findall(r"(\d+) bytes spill stores", asm.stderr)) or "?"
        ins, loops = sass_loops(sass)
        bars = sum("BAR.SYNC" in x for x in ins)
        bad += asm.returncode != 0 or not ins
        print(f"  {label}: grid {r['grid']} warps {r['num_warps']} regs {regs} spill stores {spills} B "
              f"shared {shared} B; {len(ins)} SASS, {bars} barriers")
        for first, last, size, lbars, smem in loops:
            print(f"      loop [{first}, {last}]: {size} instructions, {lbars} barriers, {smem} shared accesses")
        if asm.returncode:
            print(asm.stderr[-2000:])
    return bad


# the interpreter's checks, in groups that tests/test_triton_interpret.py runs one per process
INTERPRET_GROUPS = {
    "writes": ("check_numerics", "check_cases", "check_out_of_range", "check_padded_stride",
               "check_launch_variants", "check_vectors"),
    "row-topk": ("check_row_topk",),
    "logits-split-topk": ("check_prefill_logits", "check_split_and_dense_topk"),
    "select-tokens": ("check_select_tokens",),
}


def run_interpret(groups, rng) -> int:
    """Run the named groups' checks in order; the count of checks that failed."""
    bad = 0
    for group in groups:
        for name in INTERPRET_GROUPS[group]:
            bad += globals()[name](rng)
    return bad


def main():
    seed = (int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv
            else int.from_bytes(os.urandom(4), "little"))
    rng = np.random.default_rng(seed)
    print(f"triton_dev_check {MODE}: seed {seed}")
    if MODE == "interpret":
        groups = (sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv
                  else list(INTERPRET_GROUPS))
        unknown = [g for g in groups if g not in INTERPRET_GROUPS]
        if unknown:
            raise SystemExit(f"unknown group(s) {unknown} (known: {', '.join(INTERPRET_GROUPS)})")
        bad = run_interpret(groups, rng)
    elif MODE == "compile":
        bad = check_compile()
    elif MODE == "sass":
        bad = check_sass()
    else:
        raise SystemExit(f"unknown mode {MODE!r} (interpret | compile | sass)")
    print("TRITON DEV CHECK:", "passed" if bad == 0 else f"FAILED ({bad})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
