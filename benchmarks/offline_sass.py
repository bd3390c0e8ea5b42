"""Offline SASS of the Pallas kernels: registers, spills and instruction mix without a GPU.

Usage (any machine; needs a Python with triton 3.6.0, the version on the H200, e.g.
``python -m venv /tmp/tlvenv && /tmp/tlvenv/bin/pip install triton==3.6.0``):
  TRITON_PY=/tmp/tlvenv/bin/python python benchmarks/offline_sass.py [case ...] [--out DIR]

Each case lowers one op for CUDA on this machine (jax lowers Pallas calls to Triton
IR without a GPU, for sm_90 when none is present), captures the Triton IR of every
Pallas kernel in it, compiles that IR with triton 3.6.0 for sm_90 at the kernel's
own num_warps / num_stages, and disassembles the cubin (cuobjdump, shipped in
triton's wheel). It prints, per kernel: registers, local memory (spills), static
SASS instructions, the most frequent opcodes, and the length of each loop body.
Static counts are per kernel body, not per launch; between variants of one read-path
kernel they track Nsight Compute's executed counts on the H200.

Cases: ``cases()`` below (the top-k stages at [64, 131072], the run maxima of a
decode row, and the decode logits shape). ``--out`` keeps the .ttir, .sass and a
summary per kernel.

Limits: the pip triton is not the Triton inside jaxlib, so registers and code can
differ somewhat from the H200's (the select takes 74 registers in both, the floor 80
here against 99 there), and a kernel may fail to compile here that compiles there
(the filter kernel: triton 3.6.0's scan lowering asserts on its 8-warp cumsum).
Compare variants of one kernel with each other, not with ncu. For the write kernels
the pip triton keeps the tensors after the Hadamard replicated across a program's
threads (ttgir: linear layouts with no lane or warp bits), 8,512 static instructions
per warp for compression's 8 x 4 shape, where Nsight Compute counts 3,594 executed per
warp on the H200 for the same straight-line kernel: the H200's Triton lays it out
differently, so these counts say nothing there.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMPILE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
src, warps, stages, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
open(out, "wb").write(k.asm["cubin"])
'''


def capture(fn, *args):
    """[(name, num_warps, num_stages, ttir text)] of the Pallas kernels in fn(*args), lowered for CUDA.

    Each Triton module is run through MLIR's verifier here (it raises on an invalid one),
    the check the GPU's Triton compile starts with: a kernel can lower on the CPU with an
    scf.for whose bounds have two types (a select of int literals typed i1), which only the
    GPU would otherwise report."""
    from jax._src.pallas.triton import pallas_call_registration as reg
    found = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def spy(*a, **kw):
        res = orig(*a, **kw)
        res.module.operation.verify()
        caller = sys._getframe(1).f_locals                 # pallas_call_lowering's locals
        name = caller.get("name") or f"kernel{len(found)}"
        found.append((str(name), int(caller.get("num_warps", 4)), int(caller.get("num_stages", 1)),
                      res.module.operation.get_asm()))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = spy
    try:
        with cuda_lowering():
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    return found


def cuda_lowering():
    """A context in which Pallas calls lower for CUDA on a machine without a GPU: from JAX
    0.12 the Triton backend's lowering asks for a GPU, here an abstract H200 of a
    one-device abstract mesh (the kernels' Triton IR does not depend on the card). On a
    GPU backend nothing changes: the lowering reads the process's own device."""
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def sass_summary(cubin: str, cuobjdump: str):
    """(instruction count, Counter of opcodes, sass text) of a cubin."""
    text = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return sum(ops.values()), ops, text


def loops(sass: str):
    """[(first, last, instructions)] of each loop in the SASS: the spans closed by a
    backward branch (a loop body's static length, the count to compare between
    variants of a kernel's inner loop)."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?BRA\s+0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            lo, hi = int(m.group(2), 16), int(m.group(1), 16)
            out.append((lo, hi, (hi - lo) // 16 + 1))
    return out


def cases():
    """name -> (fn, args): ops whose kernels are worth reading offline."""
    from pallas_kernels import topk as tk
    from pallas_kernels.topk import maxima as topk_maxima
    x = jnp.zeros((64, 131072), jnp.float32)
    lens = jnp.full((64,), 131072, jnp.int32)
    xd = jnp.zeros((64, 32832), jnp.float32)                     # a decode row: 1026 pages of 32 pools
    lensd = jnp.full((64,), 32768, jnp.int32)
    out = {
        "topk": (lambda x, l: tk.topk_pools(x, l, 512, interpret=False), (x, lens)),
        "topk-decode-maxima": (lambda x, l: topk_maxima.run_maxima(x, l, 4096, interpret=False), (xd, lensd)),
    }
    try:
        import bench_writes as bw
        import numpy as np
        from pallas_kernels.writes.pool_compress import compress_prefill
        from pallas_kernels.writes.decode_update import decode_update
        layout, sc, pre = bw.prefill_case(np.random.default_rng(0), 4096, 4)
        sw = layout.strides(0)
        pargs = (layout.allocate(0), jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]), jnp.asarray(sc.ape),
                 jnp.asarray(pre["slot_mapping"]))
        out["compress"] = (lambda c, k, g, a, sl: compress_prefill(c, sw, k, g, a, sl, interpret=False), pargs)
        for tile in (4, 8):                              # the tile of large batches, and the old default
            out[f"compress-tile{tile}"] = (lambda c, k, g, a, sl, tile=tile: compress_prefill(
                c, sw, k, g, a, sl, interpret=False, tile_pools=tile), pargs)
        dl, _, dargs = bw.decode_case(np.random.default_rng(0), 4, 4)
        sd = dl.strides(0)
        out["decode-update"] = (lambda c, *a: decode_update(c, sd, *a, interpret=False),
                                (dl.allocate(0), *dargs))
    except ImportError:
        pass
    try:
        import bench_read as br
        from glm5_jax.config import IndexerConfig
        from pallas_kernels.read.paged_logits import paged_logits
        cfg = IndexerConfig()
        layout, cache, table, key, heads = br.read_case(cfg, 2, 4096)
        q8, w = br.queries(key, 2, 1, heads)
        ctx = jnp.full((2, 1), 1024, jnp.int32)
        s = layout.strides(0)
        out["logits-decode"] = (lambda c, q, w_, t, cx: paged_logits(c, s, q, w_, t, cx, interpret=False),
                                (cache, q8, w, table, ctx))
        from pallas_kernels.read.paged_logits import Tuning
        q4, w4 = br.queries(key, 2, 4, heads)         # 4 rows x 32 heads: the 128-row dot of prefill
        ctx4 = jnp.full((2, 4), 1024, jnp.int32)
        for form in ("fp8", "f16"):
            out[f"logits-rows4-{form}"] = (lambda c, q, w_, t, cx, form=form: paged_logits(
                c, s, q, w_, t, cx, interpret=False, tune=Tuning(dot=form)), (cache, q4, w4, table, ctx4))
        from pallas_kernels.read.paged_topk import paged_topk
        layout8, cache8, table8, key8, _ = br.read_case(cfg, 1, 32768)
        q8p, w8p = br.queries(key8, 1, 256, heads)               # 256 prefill rows at 8k pools
        ctx8 = jnp.full((1, 256), 8192, jnp.int32)
        s8 = layout8.strides(0)
        for form, pages, warps in (("fp8", 1, 4), ("f16", 1, 4), ("fp8", 2, 4), ("f16", 2, 4), ("fp8", 4, 8),
                                   ("f16", 4, 8)):
            out[f"fused-prefill-{form}-p{pages}-w{warps}"] = (
                lambda c, q, w_, t, cx, form=form, pages=pages, warps=warps: paged_topk(
                    c, s8, q, w_, t, cx, 512, interpret=False, dot=form, pages=pages, num_warps=warps),
                (cache8, q8p, w8p, table8, ctx8))
    except ImportError:
        pass
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help="default: all")
    ap.add_argument("--out", help="keep .ttir / .sass / summary.json here")
    ap.add_argument("--top", type=int, default=12, help="opcodes to show per kernel")
    a = ap.parse_args(argv)
    tpy = os.environ.get("TRITON_PY", "/tmp/tlvenv/bin/python")
    probe = subprocess.run([tpy, "-c", "import triton, os; print(os.path.dirname(triton.__file__))"],
                           capture_output=True, text=True)
    if probe.returncode:
        sys.exit(f"no triton at TRITON_PY={tpy}: {probe.stderr.strip()[-200:]}")
    cuobjdump = os.path.join(probe.stdout.strip(), "backends", "nvidia", "bin", "cuobjdump")
    every = cases()
    out = a.out or tempfile.mkdtemp(prefix="offline_sass_")
    os.makedirs(out, exist_ok=True)
    summary = {}
    for case in a.cases or list(every):
        fn, args = every[case]
        for i, (name, warps, stages, ttir) in enumerate(capture(fn, *args)):
            tag = f"{case}.{i}.{name}"
            src = os.path.join(out, tag + ".ttir")
            # jax may print the IR in generic form, where gpu.barrier carries a scope
            # attribute that triton 3.6.0's parser does not know (workgroup = its default)
            ttir = ttir.replace('"gpu.barrier"() <{scope = #gpu.barrier_scope<workgroup>}>', '"gpu.barrier"()')
            open(src, "w").write(ttir)
            cubin = os.path.join(out, tag + ".cubin")
            res = subprocess.run([tpy, "-c", COMPILE, src, str(warps), str(stages), cubin],
                                 capture_output=True, text=True)
            if res.returncode:
                print(f"{tag}: compile failed: {res.stderr.strip()[-300:]}")
                continue
            usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout
            reg = re.search(r"REG:(\d+)", usage)
            local = re.search(r"LOCAL:(\d+)", usage)
            meta = {"n_regs": int(reg.group(1)) if reg else -1,
                    "n_spills": f"{int(local.group(1)) if local else 0} B local"}
            n, ops, text = sass_summary(cubin, cuobjdump)
            open(os.path.join(out, tag + ".sass"), "w").write(text)
            spills = {op: ops[op] for op in ("STL", "LDL") if ops[op]}
            summary[tag] = dict(warps=warps, stages=stages, regs=meta["n_regs"], spills=meta["n_spills"],
                                instructions=n, ops=dict(ops.most_common()))
            print(f"{tag:<48} warps {warps} stages {stages}  regs {meta['n_regs']:>3}  spills "
                  f"{meta['n_spills']} {spills or ''}  SASS {n}")
            print("    " + "  ".join(f"{op} {c}" for op, c in ops.most_common(a.top)))
            body = loops(text)
            if body:
                print("    loops (static instructions per trip): " + ", ".join(
                    f"{lo:#x}-{hi:#x}: {n}" for lo, hi, n in body))
                summary[tag]["loops"] = [n for _, _, n in body]
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
    print(f"outputs under {out}")


if __name__ == "__main__":
    main()
