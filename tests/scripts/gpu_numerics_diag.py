"""GPU numerics diagnosis of the read path and the model's contractions, the
measurements behind tests/test_read_path.py's logit tolerance and behind
``glm5_jax.model.invariant.bf16``.

0. Does XLA keep a plain f32 -> bf16 -> f32 round trip before f32 arithmetic (it may
   drop it under xla_allow_excess_precision), and does ``invariant.bf16``?
1. Are the XLA reference's logits bit-equal between a whole prefill and the same
   rows in chunks (a GPU dot may pick another algorithm per shape)?
2. How far are each implementation's logits from the f64 golden scores (relative to
   the row's largest |score| and to the row's sum of |terms|), and how far does each
   read path's selection invert the golden order, against LOGIT_RTOL?
3. Inside the engine's compiled step: which projection (shape) differs between the
   XLA chain and the Pallas kernel, and is the XLA engine deterministic run to run?

usage: python3 tests/scripts/gpu_numerics_diag.py [seeds] [parts, e.g. 0,3]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, "tests")
import test_read_path as tr  # noqa: E402
import test_serving as ts  # noqa: E402
from glm5_jax import ops  # noqa: E402
from glm5_jax import reference as ref  # noqa: E402
from glm5_jax.config import IndexerConfig  # noqa: E402
from glm5_jax.layout import CacheLayout  # noqa: E402
from glm5_jax.model import invariant as inv  # noqa: E402
from pallas_kernels.contractions.ordered_linear import ordered_linear  # noqa: E402

SEEDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
print("jax", jax.__version__, jax.devices(), flush=True)


def part1(seed):
    rng = np.random.default_rng(seed)
    layout = CacheLayout(IndexerConfig(block_size=1152, topk=32), num_layers=1, num_blocks=3)
    cache = tr.random_cache(rng, layout)
    s = layout.strides(0)
    n = 37
    q8, wf = tr.random_queries(rng, 1, n, 32)
    table = jnp.asarray(tr.random_tables(rng, layout, 0, 1, 3))
    pos = jnp.asarray((np.arange(n) * 5 + 40)[None, :].astype(np.int32))
    ctx = ref.seq_lens_from_positions(pos) // s.kpool
    whole = np.asarray(jax.jit(lambda *a: ops.paged_logits(cache, layout, 0, *a, implementation="xla"))(
        q8, wf, table, ctx))
    parts = [np.asarray(jax.jit(lambda *a: ops.paged_logits(cache, layout, 0, *a, implementation="xla"))(
        q8[:, i:i + 5], wf[:, i:i + 5], table, ctx[:, i:i + 5])) for i in range(0, n, 5)]
    chunked = np.concatenate(parts, axis=1)
    fin = np.isfinite(whole)
    nd = int((whole.view(np.uint32) != chunked.view(np.uint32)).sum())
    rel = np.abs(whole[fin] - chunked[fin]).max() / np.abs(whole[fin]).max()
    print(f"[1] seed {seed}: XLA logits whole vs 5-row chunks: {nd} of {whole.size} words differ, "
          f"max rel diff {rel:.2e}", flush=True)


def part2(seed):
    rng = np.random.default_rng(seed)
    cfg, layout, sc, cache, lengths, table = tr.select_case(rng)
    r, k = cfg.kpool, cfg.topk_pools
    table = table[:1]
    pos = np.arange(lengths[0], dtype=np.int32)[None, :]
    b, n = pos.shape
    q8, wf = tr.random_queries(rng, b, n, 16)
    gold = tr.golden_scores(sc, q8, wf, np.zeros(n, int), pos.reshape(-1), r)
    # the error scale of a row: sum over heads of |w_h| * sum_d |q_hd k_d| * scale
    qf = np.asarray(q8.astype(jnp.float32), np.float64).reshape(n, -1, 128)
    wa = np.abs(np.asarray(wf, np.float64).reshape(n, -1))
    kb, ks = tr.golden_pools(sc)[0]
    import ml_dtypes
    k8 = kb.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mag = np.einsum("nh,nhm->nm", wa, np.abs(qf) @ np.abs(k8).T * ks.astype(np.float64))
    seq = (pos + 1).reshape(-1)
    ctx = jnp.asarray((seq // r).reshape(b, n).astype(np.int32))
    for impl in ("xla", "pallas"):
        lg = np.asarray(ops.paged_logits(cache, layout, 0, q8, wf, jnp.asarray(table), ctx,
                                         implementation=impl), np.float64).reshape(n, -1)[:, :gold.shape[1]]
        fin = np.isfinite(gold)
        err = np.where(fin, np.abs(lg - np.where(fin, gold, 0)), 0)
        rowmax = np.abs(np.where(fin, gold, 0)).max(1, keepdims=True)
        print(f"[2] seed {seed} {impl:6s} logits vs golden: max err/rowmax {np.nanmax(err / np.maximum(rowmax, 1e-30)):.2e}"
              f", max err/row |terms| {np.nanmax(np.where(fin, err / np.maximum(mag[:, :gold.shape[1]], 1e-30), 0)):.2e}",
              flush=True)
    args = (cache, q8, wf, jnp.asarray(table), jnp.asarray(pos))
    for impl, path in (("xla", None), ("pallas", "fused"), ("pallas", "unfused")):
        toks = np.asarray(jax.jit(lambda c, q, w, t, p, impl=impl, path=path: ops.select_tokens(
            c, layout, 0, q, w, t, p, short_context=False, implementation=impl, path=path))(*args))
        ids, _ = tr.split_tokens(toks, k, r)
        worst, where = 0.0, None
        for row in range(n):
            nv = min(k, seq[row] // r)
            if nv < 2:
                continue
            sg = gold[row, ids[row, :nv]]
            m = np.abs(gold[row][np.isfinite(gold[row])]).max()
            bad = np.diff(sg).max() / m
            if bad > worst:
                worst, where = bad, row
        print(f"[2] seed {seed} {path or impl:8s}: worst order inversion / rowmax {worst:.2e} (row {where}); "
              f"test tolerance {tr.LOGIT_RTOL:.0e}", flush=True)


def part3(seed):
    rng = np.random.default_rng(seed)
    orig = {"bf16": inv.linear, "f32": inv.linear_f32}

    def both(mode):
        def f(x, w):
            a = orig[mode](x, w)
            kk = x.shape[-1]
            xx = x.reshape(-1, kk) if mode == "bf16" else x.reshape(-1, kk).astype(jnp.float32)
            ww = w if mode == "bf16" else w.astype(jnp.float32)
            bq = ordered_linear(xx, ww, mode=mode).reshape(a.shape)
            nd = jnp.sum(lax.bitcast_convert_type(a, jnp.uint32) != lax.bitcast_convert_type(bq, jnp.uint32))
            sub = jnp.sum((jnp.abs(xx.astype(jnp.float32)) < 1.2e-38) & (xx != 0))
            jax.debug.print(mode + f" x{tuple(x.shape)} w{tuple(w.shape)}: " +
                            "{nd} words differ, max|diff| {md}, subnormal x {sub}",
                            nd=nd, md=jnp.max(jnp.abs(a - bq)), sub=sub)
            return a
        return f

    model = ts.random_model(rng)
    prompts = [ts.tokens(rng, int(rng.integers(40, 100)))]
    gs = int(rng.integers(2**31))
    results = {}
    def kernel_only(mode):                       # this mode by the kernel, the other by XLA
        def f(x, w):
            kk = x.shape[-1]
            xx = x.reshape(-1, kk) if mode == "bf16" else x.reshape(-1, kk).astype(jnp.float32)
            ww = w if mode == "bf16" else w.astype(jnp.float32)
            return ordered_linear(xx, ww, mode=mode).reshape(x.shape[:-1] + (w.shape[1],))
        return f

    for mode in ("xla", "xla-again", "pallas", "both", "bf16-kernel", "f32-kernel"):
        inv.CONTRACTIONS = "pallas" if mode == "pallas" else "xla"   # explicit: "auto" is pallas on a GPU
        jax.clear_caches()                       # the engine's step is cached: trace anew
        if mode == "both":
            inv.linear, inv.linear_f32 = both("bf16"), both("f32")
        elif mode == "bf16-kernel":
            inv.linear = kernel_only("bf16")
        elif mode == "f32-kernel":
            inv.linear_f32 = kernel_only("f32")
        e = ts.make_engine(model, np.random.default_rng(gs))
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, 2)
        e.run()
        results[mode] = ([e.get_output(f"r{i}").output_tokens for i in range(len(prompts))], e.cache_bytes(0))
        inv.linear, inv.linear_f32 = orig["bf16"], orig["f32"]
    base = results["xla"]
    for mode, (toks, by) in results.items():
        print(f"[3] seed {seed} engine {mode:9s}: tokens {'==' if toks == base[0] else '!='} xla, "
              f"{int((by != base[1]).sum())} cache bytes differ from xla", flush=True)


def part0():
    """Does XLA keep a plain f32 -> bf16 -> f32 round trip before f32 arithmetic?"""
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    want = x.astype(jnp.bfloat16).astype(np.float32) * np.float32(3)
    for name, rnd in (("astype", lambda v: v.astype(jnp.bfloat16)), ("inv.bf16", inv.bf16)):
        got = np.asarray(jax.jit(lambda v: rnd(v).astype(jnp.float32) * 3.0)(x))
        print(f"[0] {name:8s} then * 3.0 in one jit: {int((got != want).sum())} of {x.size} not rounded to bf16",
              flush=True)


PARTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["0", "1", "2", "3"]
if "0" in PARTS:
    part0()
for sd in range(SEEDS if "1" in PARTS else 0):
    part1(1000 + sd)
for sd in range(SEEDS if "2" in PARTS else 0):
    part2(2000 + sd)
for sd in range(2 if "3" in PARTS else 0):
    part3(3000 + sd)
print("DIAG DONE")
