"""Where the device time of one serving step goes, kernel by kernel, from a profiler trace.

Usage (GPU machine):
    PYTHONPATH=$PWD python benchmarks/profile_step.py [--calls 10] [--top 25] [--json out.json]
        [--gather-attention] [--word-gather] [--contraction-shape UNROLL:TILE_COLS] [--implementation pallas]
    (each flag swaps one part of the step for another form with the same bits, for an A/B
    in one run: see --help)

Serves bench_scaleout's GPU workload on one device (device_step.capture: the decode-only
step with the most decode rows and the step with the most tokens), then replays each
kept step ``--calls`` times, each call queued behind a busy kernel and waited for, under
``jax.profiler.trace``. Reported per step: the span (first kernel's start to last
kernel's end, median over the calls), the summed kernel time, the kernel count, and
the ``--top`` kernels by time (median per call), each with its share of the span and
the JAX operation it comes from (the ``op_name`` of its HLO instruction in the compiled
step, where the names match), and the time of kernel groups: the indexer's own Pallas
kernels (``kpool_*``), its Triton-language kernels (by their function names), the model's
batch-invariant contractions (``ordered_*``) and the rest (XLA). Only the kernels' own times, no harness.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from glm5_jax import simulate
from glm5_jax.model import invariant
from glm5_jax.model.decoder import Decoder
from glm5_jax.serving import engine as eng_mod
from glm5_jax.serving import sharding

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import trace_read as tr  # noqa: E402
from bench_scaleout import GPU_OVERRIDES  # noqa: E402
from device_step import capture, workload_engine  # noqa: E402


# kernel name prefixes reported as groups: the indexer's Pallas kernels (kpool_*: writes,
# query quantisation, paged logits, top-k), the model's batch-invariant contractions
GROUPS = ("kpool_", "ordered_linear", "ordered_sumsq")
TRITON_GROUP = "indexer Triton (triton_lang/*_kernel)"


def triton_kernel_names() -> set:
    """The names of the Triton-language kernels (pallas_kernels/triton_lang), which the
    profiler reports by their function names."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pallas_kernels", "triton_lang")
    names = set()
    for path in glob.glob(os.path.join(root, "*.py")):
        with open(path) as fh:
            names.update(re.findall(r"@triton\.jit\s*\ndef (\w+)\(", fh.read()))
    return names


def group_of(name: str, triton_names: set) -> str:
    if name.split(":")[0].strip() in triton_names:
        return TRITON_GROUP
    return next((g + "*" for g in GROUPS if name.startswith(g)), "XLA (fusions, sorts, copies)")


def step_call(eng, model, plans, shape, cache_row):
    """(f, args): one call of the engine's compiled step for these rows from cache_row;
    f returns the new cache (donated) so calls can be chained."""
    mesh = sharding.single_device_mesh()
    state = sharding.replicated(nnx.split(model)[1], mesh)
    flat, fields = eng._batch(shape, plans)
    prev = sharding.put_per_shard(np.zeros((1, eng.tokens_out), np.int32), mesh)
    kw = dict(fields=fields, graphdef=eng._graphdef, layout=eng.layout, implementation=eng.implementation,
              mesh=mesh, contractions=invariant.contractions(), tokens_out=eng.tokens_out)
    cache = [sharding.put_per_shard(cache_row[None], mesh)]

    def f():
        cache[0], tok, _ = eng_mod._step(state, cache[0], flat, prev, **kw)
        return tok
    hlo = eng_mod._step.lower(state, cache[0], flat, prev, **kw).compile().as_text()
    return f, hlo


def op_names(hlo: str) -> dict:
    """{instruction name: op_name} of the compiled HLO's instructions."""
    out = {}
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo):
        out.setdefault(m.group(1), m.group(2))
    return out


def profile(f, calls: int):
    busy, busy_arg = tr.busy_kernel(), np.zeros((16,), np.float32)
    jax.block_until_ready(f())
    jax.block_until_ready(busy(busy_arg))
    d = tempfile.mkdtemp(prefix="profile_step_")
    with jax.profiler.trace(d):
        for _ in range(calls):
            busy(busy_arg)
            jax.block_until_ready(f())
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no xplane.pb under {d}")
    return tr.group_calls(tr.device_events(paths[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--warm-steps", type=int, default=60)
    ap.add_argument("--json")
    ap.add_argument("--implementation", choices=("pallas", "xla"), default=None,
                    help="Engine(implementation=...) for every op instead of each op's default, for an A/B")
    ap.add_argument("--contraction-shape", metavar="UNROLL:TILE_COLS",
                    help="the ordered contraction kernel's compiled unroll and its tile width for the "
                         "transposed operand (the attention's scores) instead of ordered_linear.UNROLL and "
                         "TILE_COLS_TRANSPOSED, e.g. 4:64, for an A/B")
    ap.add_argument("--word-gather", action="store_true",
                    help="the attention on K/V gathered word by word (gather_kv(by_rows=False)), for an A/B")
    ap.add_argument("--gather-attention", action="store_true",
                    help="the attention on a gathered K/V copy (gather_kv) instead of the contraction "
                         "kernels reading the cache's rows, for an A/B")
    a = ap.parse_args(argv)
    if a.contraction_shape:                      # set before anything is traced
        import pallas_kernels.contractions.ordered_linear as ol
        try:
            ol.UNROLL, ol.TILE_COLS_TRANSPOSED = (int(v) for v in a.contraction_shape.split(":"))
        except ValueError:
            ap.error(f"--contraction-shape: expected UNROLL:TILE_COLS, got {a.contraction_shape!r}")
    if a.word_gather or a.gather_attention:
        from glm5_jax.model import decoder as model_mod
        model_mod.ATTENTION_FROM_ROWS = False
    if a.word_gather:
        import functools
        model_mod.gather_kv = functools.partial(model_mod.gather_kv, by_rows=False)
    triton_names = triton_kernel_names()
    w = simulate.preset("gpu", devices=1, implementation=a.implementation, **GPU_OVERRIDES)
    model = Decoder.random(w.model_config, seed=w.seed)
    eng = workload_engine(w, model, simulate.plan_num_blocks(w, model))
    impl = eng.implementation or "each op's default"
    print(f"profile_step: {jax.default_backend()} {jax.devices()[0].device_kind}, implementation {impl}"
          f"{f', contraction unroll:tile {a.contraction_shape}' if a.contraction_shape else ''}"
          f"{', K/V gathered by words' if a.word_gather else ''}"
          f"{', attention on gathered K/V' if a.gather_attention and not a.word_gather else ''}",
          flush=True)
    out = {}
    for kind, (plans, shape, cache_row) in capture(eng, a.warm_steps).items():
        f, hlo = step_call(eng, model, plans, shape, cache_row)
        calls = profile(f, a.calls)
        names = op_names(hlo)
        per = collections.defaultdict(list)
        for c in calls:
            tot = collections.Counter()
            for nm, dur in zip(c["names"], c["durs_ns"]):
                tot[nm] += dur
            for nm, dur in tot.items():
                per[nm].append(dur)
        med = {nm: float(np.median(v + [0.0] * (len(calls) - len(v)))) / 1e3 for nm, v in per.items()}
        span = float(np.median([c["span_ns"] for c in calls])) / 1e3
        kern = float(np.median([c["kernels_ns"] for c in calls])) / 1e3
        n = int(np.median([c["n"] for c in calls]))
        toks = sum(len(x.token_ids) for p in plans for x in p.dec_rows + p.pre_rows)
        print(f"\n{kind}: {toks} tokens, shape {shape}\n  span {span:.1f} us, kernels {kern:.1f} us, "
              f"{n} kernels per call")
        groups = collections.Counter()
        for nm, us in med.items():
            groups[group_of(nm, triton_names)] += us
        for g, us in groups.most_common():
            print(f"  {us:9.1f} us {us / span:6.1%}  all {g} kernels")
        rows = []
        for nm, us in sorted(med.items(), key=lambda kv: -kv[1])[:a.top]:
            base = nm.split(":")[0].strip()
            src = names.get(base, "")
            rows.append(dict(kernel=nm, us=us, share=us / span, op=src))
            print(f"  {us:9.1f} us {us / span:6.1%}  {nm[:48]:<48} {src[-110:]}")
        out[kind] = dict(tokens=toks, span_us=span, kernels_us=kern, kernels=n, groups=dict(groups), top=rows)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
