"""The benchmark tools: the harnesses must time every chained call (XLA deletes calls
whose output nobody reads and merges identical ones, so a harness that lets it times
one call and divides by ten), and the tools and gpu.sh's steps must still run against
the shipped kernels."""
import sys
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))


def _count_dots(monkeypatch, module, call):
    captured = {}
    orig = jax.jit

    def spy(fn=None, **kw):
        j = orig(fn, **kw) if fn is not None else orig(**kw)
        captured["j"] = j
        return j
    monkeypatch.setattr(module.jax, "jit", spy)
    args = call()
    monkeypatch.setattr(module.jax, "jit", orig)
    hlo = captured["j"].lower(*args).compile().as_text()
    return sum(1 for line in hlo.splitlines()
               if line.strip().startswith(("%ynn_fusion", "%dot", "%fusion")) and "dot" in line)


def test_read_harness_keeps_every_call(monkeypatch):
    import bench_read as br
    c = jnp.ones((128, 128))
    f = lambda c, a, i: jnp.sin(c @ (a + i.astype(jnp.float32)))
    n = _count_dots(monkeypatch, br, lambda: (br.time_read(f, (c, c, jnp.int32(0)), reps=4, trials=1, fixed=1),
                                              (c, c, jnp.int32(0)))[1])
    assert n == 4, f"the chain of 4 calls compiled to {n} matmuls"


def test_read_harness_keeps_calls_that_ignore_their_int_argument(monkeypatch):
    """lax.top_k(x, k) reads only the float scores: its calls must not merge either."""
    import bench_read as br
    x = jnp.ones((128, 128))
    f = lambda x, lengths: jnp.sin(x @ x)
    n = _count_dots(monkeypatch, br, lambda: (br.time_read(f, (x, jnp.int32(0)), reps=4, trials=1),
                                              (x, jnp.int32(0)))[1])
    assert n == 4, f"the chain of 4 calls compiled to {n} matmuls"


def test_write_harness_keeps_every_call(monkeypatch):
    import _timing
    a = jnp.ones((128, 128))
    step = lambda s, a: jnp.sin(s @ a)
    n = _count_dots(monkeypatch, _timing,
                    lambda: (_timing.time_chain(step, jnp.ones((128, 128)), a, reps=4, trials=1),
                             (jnp.ones((128, 128)), a))[1])
    assert n == 4, f"the chain of 4 calls compiled to {n} matmuls"


def test_read_harness_perturbs_only_what_it_is_told(monkeypatch):
    """perturb=(1,) chains the calls through the small lengths argument only: the
    calls still do not merge, and no call adds a 0 to the big scores argument (which
    XLA cannot fuse into a Pallas kernel, so it wrote the scores out on every call)."""
    import bench_read as br
    x = jnp.ones((128, 128))
    lengths = jnp.full((128,), 128, jnp.int32)
    f = lambda x, l: jnp.sin(x @ br.masked(x, l))
    args = (x, lengths)
    n = _count_dots(monkeypatch, br, lambda: (br.time_read(f, args, reps=4, trials=1, perturb=(1,)), args)[1])
    assert n == 4, f"the chain of 4 calls compiled to {n} matmuls"
    seen = {}
    orig = br.jax.jit

    def spy(fn=None, **kw):
        seen["jit"] = orig(fn, **kw)
        return seen["jit"]
    monkeypatch.setattr(br.jax, "jit", spy)
    br.time_read(f, args, reps=3, trials=1, perturb=(1,))
    jaxpr = str(jax.make_jaxpr(seen["jit"])(*args))
    assert jaxpr.count("f32[128,128] = add") == 0 and jaxpr.count("i32[128] = add") == 2
    with pytest.raises(ValueError, match="perturb"):
        br.time_read(f, args, reps=2, trials=1, perturb=(0, 2))


def test_offline_sass_captures_each_kernel():
    """benchmarks/offline_sass.py reads each Pallas kernel's Triton IR out of jax's
    CUDA lowering (on this CPU, through jax internals that may move): one module per
    kernel of the op, in launch order, with its name and launch parameters."""
    import offline_sass as osass
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import driver
    x = jnp.zeros((8, 8192), jnp.float32)
    got = osass.capture(lambda x, l: driver.topk_pools(x, l, 64, interpret=False), x, jnp.full((8,), 8192, jnp.int32))
    assert [g[0] for g in got] == ["kpool_topk_maxima", "kpool_topk_floor", "kpool_topk_filter",
                                   "kpool_topk_select", "kpool_topk_fallback"]
    assert [g[1] for g in got] == [4, tk.ROW_WARPS, 8, 4, 4]
    assert all("tt.func" in g[3] for g in got)


def test_trace_read_groups_kernels_by_call():
    """trace_read.py: each call's kernels are the events between one busy kernel and the
    next; warm-up events before the first busy kernel are not a call; span runs from
    the first kernel's start to the last one's end, gaps included."""
    import trace_read as tr
    ev = [(0, 5, "warm"), (10, 100, "a trace_busy b"), (120, 50, "k1"), (172, 30, "k2"),
          (300, 100, tr.BUSY_NAME), (410, 40, "k1"), (455, 20, "k2"), (600, 100, tr.BUSY_NAME),
          (710, 44, "k1")]
    calls = tr.group_calls(sorted(ev))
    assert [(c["span_ns"], c["kernels_ns"], c["n"]) for c in calls] == [(82, 80, 2), (65, 60, 2), (44, 44, 1)]
    s = tr.summarize(calls)
    assert s["order"] == ["k1", "k2"] and s["calls"] == 3
    assert abs(s["span_us"] - 0.065) < 1e-9 and abs(s["gaps_us"] - (0.065 - 0.060)) < 1e-9
    assert [round(t * 1e3) for t in s["per_kernel_us"]] == [45, 25]      # medians over the 2 full calls


def test_profile_step_groups_the_indexer_kernels():
    """profile_step.py: the Triton-language kernels, which the profiler names by their
    function names, form the indexer's Triton group; kpool_* the Pallas one; the
    contractions theirs; anything else counts as XLA."""
    import profile_step as ps
    names = ps.triton_kernel_names()
    assert {"paged_logits_kernel", "candidates_kernel", "rank_kernel", "topk_kernel", "compress_prefill_kernel",
            "decode_update_kernel", "seed_tail_kernel"} <= names
    assert ps.group_of("candidates_kernel", names) == ps.TRITON_GROUP
    assert ps.group_of("kpool_paged_topk__1", names) == "kpool_*"
    assert ps.group_of("ordered_linear_rows", names) == "ordered_linear*"
    for other in ("loop_fusion_3", "sort_10_1", "input_concatenate_fusion"):
        assert ps.group_of(other, names) == "XLA (fusions, sorts, copies)"


def test_trace_read_busy_kernel_runs():
    """The busy kernel is a real Pallas kernel (interpret mode here) that returns its input
    after `iters` multiply-adds."""
    import numpy as np
    import trace_read as tr
    out = np.asarray(tr.busy_kernel(100, interpret=True)(jnp.full((16,), 2.0, jnp.float32)))
    want = np.float32(2.0)
    for _ in range(100):
        want = np.float32(want * np.float32(0.999999) + np.float32(1e-6))
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_trace_writes_threads_the_donated_state():
    """trace_writes.py runs `state = f(state, *args)` once to compile and then once per
    traced call, each on the state the last one returned. On the GPU the calls come
    from a profiler trace (the busy kernel compiled, so the calls can be told apart);
    off it the script times host wall clock instead (the smoke path CI can run)."""
    import numpy as np
    import trace_read as tr
    import trace_writes as tw
    f = tw.donated(lambda s, d: s + d)
    busy = tr.busy_kernel(10, interpret=jax.default_backend() != "gpu")
    s, state = tw.trace_state_calls(f, jnp.zeros((8,), jnp.int32), (jnp.int32(3),), 4, busy,
                                    jnp.ones((16,), jnp.float32))
    np.testing.assert_array_equal(np.asarray(state), np.full((8,), 15, np.int32))
    assert s["calls"] == 4 and s["span_us"] > 0


def test_write_byte_counts():
    """Bytes each write must move (each input read once, each output written once)."""
    import bench_writes as bw
    assert bw.compress_bytes(4096, 1024) == 4096 * (256 + 256 + 4) + 1024 * (128 + 4)
    assert bw.seed_bytes(4096, 64, 4) == 4096 * 4 + 64 * 4 * 2 * 256 * 2
    assert bw.decode_bytes(256, 4, 256, 4) == 256 * 4 * (2 * 256 + 12 + 2 * 256) + 256 * (3 * 2 * 256 + 132)


def test_write_variants_trace_against_the_shipped_kernels():
    """trace_writes.py --decode-variants and --compress-shapes call the Pallas kernels with
    launch-shape keywords (path, num_warps, tile_pools). When a kernel's signature changes,
    a stale variant only fails on the GPU, in the middle of a device run. Trace each form
    into both decode programs' shapes (next_n 1 and 4) and the compression, abstractly: no
    compilation."""
    import numpy as np
    import bench_writes as bw
    from pallas_kernels.writes.decode_update import decode_update
    from pallas_kernels.writes.pool_compress import compress_prefill
    rng = np.random.default_rng()
    failed = []
    for nn in (1, 4):
        lay, _, dargs = bw.decode_case(rng, 2, nn)
        s = lay.strides(0)
        for path in ("forward", "walk"):
            for warps in (1, 2, 4, 8):
                try:
                    out = jax.eval_shape(lambda c, *x: decode_update(c, s, *x, num_warps=warps, path=path,
                                                                     interpret=True), lay.allocate(0), *dargs)
                    assert out.shape == (lay.total_words,), out.shape
                except Exception as e:          # noqa: BLE001 - collect every stale form, then fail once
                    failed.append(f"decode_update next_n={nn} {path}:{warps}: {type(e).__name__}: {e}"[:300])
    layout, sc, pre = bw.prefill_case(rng, 64, 2)
    s = layout.strides(0)
    cargs = tuple(jnp.asarray(a) for a in (pre["key"], pre["gate"], sc.ape, pre["slot_mapping"]))
    for tile, warps in ((1, 4), (2, 4), (4, 2), (8, 8)):
        try:
            out = jax.eval_shape(lambda c, *x: compress_prefill(c, s, *x, tile_pools=tile, num_warps=warps,
                                                                interpret=True), layout.allocate(0), *cargs)
            assert out.shape == (layout.total_words,), out.shape
        except Exception as e:                  # noqa: BLE001
            failed.append(f"compress_prefill {tile}x{warps}: {type(e).__name__}: {e}"[:300])
    assert not failed, "\n".join(failed)


def test_profile_modes_run_every_case(capsys):
    """trace_writes.py --profile and trace_read.py --profile (gpu.sh's ncu step) run one call
    of each case's Pallas path inside the CUDA profiler's window, after a warm-up call.
    Here (no libcudart on the CPU) the calls still run, in interpret mode at small sizes,
    in the order given, and the decode update's call threads its donated cache."""
    import numpy as np
    import _timing
    import trace_read as tr
    import trace_writes as tw
    tw.main(["--profile", "decode:2:1", "decode:2:4", "seed:512", "compress:512"])
    out = capsys.readouterr().out
    assert ("profiled, in order: decode_update B=2 next_n=1; decode_update B=2 next_n=4; "
            "seed 512 tokens / 64 requests; compress 512 tokens / 64 requests") in out, out
    tr.main(["--profile", "--batches", "2", "--contexts", "4096", "--topk-rows", "4", "--topk-cols", "2048"])
    out = capsys.readouterr().out
    assert "profiled, in order: select_tokens pallas B=2 ctx=4096; topk_pools pallas [4, 2048] k=512" in out, out
    tr.main(["--profile", "--skip-decode", "--topk-rows", "4", "--topk-cols", "2048", "--topk-ks", "64", "128",
             "--impls", "pallas"])
    out = capsys.readouterr().out
    assert "profiled, in order: topk_pools pallas [4, 2048] k=64; topk_pools pallas [4, 2048] k=128" in out, out
    with pytest.raises(SystemExit, match="bad case"):
        tw.profile_case(np.random.default_rng(0), "decode:2")
    call = _timing.threaded(jax.jit(lambda s, d: s + d, donate_argnums=0), jnp.zeros((4,), jnp.int32), jnp.int32(2))
    assert _timing.profile_calls([("add", call)]) == ["add"]
    np.testing.assert_array_equal(np.asarray(call()), np.full((4,), 6, np.int32))    # 2 calls above, this one


BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_benchmark_imports():
    """Every tool in benchmarks/ imports (and so finds the helpers it takes from the
    others and from the package), and every script compiles."""
    import importlib
    import py_compile
    for path in sorted(BENCHMARKS.glob("*.py")):
        py_compile.compile(str(path), doraise=True)
        if "def main(" in path.read_text():             # a tool, not a bare script (_sass_summary.py)
            importlib.import_module(path.stem)


def test_gpu_sh_steps_name_existing_tools():
    """benchmarks/gpu.sh: every step in ALL_STEPS has its step function and every function
    its step, every Python file a step runs exists, the script parses, and an unknown step
    is refused (exit 2) before anything runs."""
    import re
    import subprocess
    text = (BENCHMARKS / "gpu.sh").read_text()
    steps = " ".join(re.findall(r'ALL_STEPS\+?="([^"]*)"', text)).split()
    funcs = re.findall(r"^step_(\w+)\(\) \{", text, re.M)
    assert steps and sorted(s.replace("-", "_") for s in steps) == sorted(funcs), (steps, funcs)
    root = BENCHMARKS.parent
    paths = set(re.findall(r"\b((?:benchmarks|tests)/[\w/]+\.py)\b", text))
    assert any(p.startswith("benchmarks/") for p in paths) and any(p.startswith("tests/") for p in paths), paths
    missing = sorted(p for p in paths if not (root / p).exists())
    assert not missing, f"gpu.sh runs files that do not exist: {missing}"
    subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu.sh")], check=True)
    r = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh")], env={"STEPS": "no-such-step", "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown step 'no-such-step'" in r.stderr, (r.returncode, r.stderr)


def test_the_tree_cites_existing_tools_and_steps():
    """Every benchmarks/ or tests/scripts/ file that the docs, code or notebooks name
    exists, and every `STEPS=...` they give to gpu.sh names its steps."""
    import re
    import sys
    sys.path.insert(0, str(BENCHMARKS.parent / "tests"))
    from test_tree_is_current import tracked_files
    root = BENCHMARKS.parent
    text = (BENCHMARKS / "gpu.sh").read_text()
    steps = set(" ".join(re.findall(r'ALL_STEPS\+?="([^"]*)"', text)).split())
    missing, unknown = [], []
    for path in tracked_files():
        rel = path.relative_to(root).as_posix()
        body = path.read_text(encoding="utf-8", errors="replace")
        for i, line in enumerate(body.splitlines(), 1):
            for name in re.findall(r"\b((?:benchmarks|tests/scripts)/[\w.]+\.(?:py|sh))\b", line):
                if not (root / name).exists():
                    missing.append(f"{rel}:{i}: {name}")
            for value in re.findall(r'\bSTEPS=(?:"([^"$]*)"|([\w-]+))', line):
                unknown += [f"{rel}:{i}: {s}" for s in " ".join(value).split() if s not in steps]
    assert not missing, "files named that do not exist:\n" + "\n".join(missing)
    assert not unknown, "gpu.sh steps that do not exist:\n" + "\n".join(unknown)


def stand_in_triton_modules(monkeypatch, **modules):
    """Replace modules of pallas_kernels.triton_lang for one test: in sys.modules and as
    the package's attributes (``from pallas_kernels.triton_lang import x`` reads the
    attribute first, so a module a GPU run imported earlier would win otherwise)."""
    import pallas_kernels.triton_lang as package
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, f"pallas_kernels.triton_lang.{name}", module)
        monkeypatch.setattr(package, name, module, raising=False)


def test_bench_prefill_profile_runs_the_named_kernel(monkeypatch):
    """bench_prefill.py --profile (gpu.sh's ncu cases tc-rows and tc-logits): "rows", the
    default, runs the row top-k of a prefill's first chunk and of its last chunk's worth
    of rows, "logits" the logits kernel on the last chunk, each call once inside the
    profiler's window; another kernel name is refused. Here the Triton modules are
    stand-ins that record their calls, so the CPU runs the planning."""
    import types

    import bench_prefill as bp
    from pallas_kernels.core import addressing as addr
    from pallas_kernels.read import workspace
    ran = []

    def paged_logits(cache, s, q, w, table, ctx, fill, maxima, tune):
        ran.append(("logits", q.shape[1], ctx.shape[1], fill, maxima, tune))
        rows, cols = ctx.shape[1], addr.pools_in_pages(s, table.shape[1])
        return jnp.zeros((1, rows, cols), jnp.float32), jnp.zeros((1, rows, workspace.maxima_cols(cols)), jnp.uint32)

    def topk_pools(scores, lengths, k, maxima):
        ran.append(("topk", scores.shape[0], lengths.shape[0], k, maxima.shape[0]))
        return jnp.zeros((scores.shape[0], k), jnp.int32)

    stand_in_triton_modules(monkeypatch, prefill_logits=types.SimpleNamespace(paged_logits=paged_logits,
                                                                               PREFILL="prefill"),
                            topk_rows=types.SimpleNamespace(topk_pools=topk_pools))
    monkeypatch.setattr(bp, "profile_calls", lambda calls: [name for name, call in calls if call() is not None])
    tokens, k = 3000, bp.IndexerConfig().topk_pools
    rows = bp.main(["--profile", "--prefills", str(tokens)])
    assert len(rows) == 2 and rows[0].startswith("row top-k 2k first ") and rows[1].startswith("row top-k 2k last ")
    n = int(rows[0].split()[-2])
    assert ran == [("logits", n, n, False, True, "prefill")] * 2 + [("topk", n, n, k, n)] * 2, ran  # scores, calls
    ran.clear()
    assert bp.main(["--profile", "logits", "--prefills", str(tokens)]) == [f"logits 2k last {n} rows"]
    assert ran == [("logits", n, n, False, True, "prefill")], ran
    with pytest.raises(SystemExit):
        bp.main(["--profile", "topk", "--prefills", str(tokens)])


def test_trace_read_topk_forms_checks_and_prints_every_form(monkeypatch, capsys):
    """trace_read.py --topk-forms (the table behind topk_pools' default): per shape and k
    it times the sampled form, one program per row where that finishes in time, and the
    Pallas kernels, stops when a form's ids differ, and skips shapes past 2 GiB. Here
    the Triton modules are stand-ins (the reference's top-k) and the traces fixed
    spans, so the CPU runs the table's logic."""
    import types

    import trace_read as tr
    from glm5_jax import reference as ref
    ids = lambda v, l, k: ref.topk_pools(v, l, k)                              # noqa: E731
    dense = types.SimpleNamespace(sample_guesses=lambda v, l, k: (l, l),
                                  collect_candidates=lambda v, l, g, c, k: (v, l),
                                  select_candidates=lambda v, l, cand, k: ids(v, l, k))
    rows = types.SimpleNamespace(topk_pools=lambda v, l, k: ids(v, l, k))
    stand_in_triton_modules(monkeypatch, dense_topk=dense, topk_rows=rows)
    monkeypatch.setattr(tr.ops, "topk_pools", lambda v, l, k, implementation=None: ids(v, l, k))
    monkeypatch.setattr(tr, "busy_kernel", lambda: None)
    monkeypatch.setattr(tr, "trace_many", lambda fns, calls, busy, arg: {
        name: (jax.block_until_ready(f(*args)),) for name, (f, args) in fns.items()})
    monkeypatch.setattr(tr, "summarize", lambda calls: {"span_us": 2.5})
    tr.main(["--topk-forms", "--topk-form-rows", "3", "1", "--topk-form-cols", "40", "70000",
             "--topk-ks", "4", "8", "--calls", "2"])
    out = capsys.readouterr().out
    assert "[3, 40] read 2.5; k=4: sampled 2.5 / rows 2.5 / pallas 2.5; k=8: sampled 2.5 / rows 2.5" in out
    assert "[3, 70000] read 2.5; k=4: sampled 2.5 / rows - / pallas 2.5" in out
    assert "[1, 40]" in out and "skipped" not in out
    dense.select_candidates = lambda v, l, cand, k: ids(v, l, k) + 1
    with pytest.raises(SystemExit, match="ids differ"):
        tr.main(["--topk-forms", "--topk-form-rows", "2", "--topk-form-cols", "40", "--topk-ks", "4"])
    tr.main(["--topk-forms", "--topk-form-rows", "8192", "--topk-form-cols", "70000", "--topk-ks", "4"])
    assert "skipped: more than 2 GiB" in capsys.readouterr().out


def test_trace_many_splits_one_session_in_call_order(monkeypatch):
    """trace_read.trace_many: the functions' calls, traced in one session, come back per
    function in the order they ran (`calls` each, split at the busy kernels); a trace
    holding another count of calls is an error, and a single function gets all the
    trace holds, as trace_calls does. Here the profiler and its events are stand-ins."""
    import contextlib
    import glob as glob_mod

    import trace_read as tr
    ran = []
    fns = {name: ((lambda name=name: ran.append(name) or 0), ()) for name in ("a", "b", "c")}

    def events(warm=3, extra=0):
        out, t = [], 0.0
        for name in ran[warm:] + ["c"] * extra:                  # the traced calls, after the warm-ups
            out += [(t, 1.0, tr.BUSY_NAME), (t + 2.0, 3.0 + len(name), f"kernel_{name}")]
            t += 10.0
        return out

    monkeypatch.setattr(tr.jax.profiler, "trace", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(glob_mod, "glob", lambda *a, **k: ["x.xplane.pb"])
    monkeypatch.setattr(tr.jax, "block_until_ready", lambda v: v)
    busy = lambda arg: None                                          # noqa: E731
    monkeypatch.setattr(tr, "device_events", lambda path: events())
    got = tr.trace_many(fns, 2, busy, None)
    assert ran == ["a", "b", "c", "a", "a", "b", "b", "c", "c"]
    assert list(got) == ["a", "b", "c"]
    assert all([c["names"] for c in got[n]] == [[f"kernel_{n}"]] * 2 for n in "abc")
    ran.clear()
    monkeypatch.setattr(tr, "device_events", lambda path: events(extra=1))
    with pytest.raises(RuntimeError, match="7 calls, not 2 x 3"):
        tr.trace_many(fns, 2, busy, None)
    ran.clear()
    monkeypatch.setattr(tr, "device_events", lambda path: events(warm=1, extra=1))
    assert len(tr.trace_calls(fns["a"][0], (), 2, busy, None)) == 3


def test_bench_prefill_profile_runs_the_first_and_last_chunks(monkeypatch, capsys):
    """bench_prefill.py --profile (gpu.sh's ncu case tc-rows): the row top-k of each
    prefill's first and last chunk's worth of rows, on their logits and maxima, one call each in
    the profiler's window. The Triton modules are stand-ins here (zero logits of the
    kernel's shapes, the reference's top-k), so the CPU runs the planning and the calls."""
    import types

    import bench_prefill as bp
    import numpy as np
    from glm5_jax import reference as ref
    from pallas_kernels.core import addressing as addr
    from pallas_kernels.read import workspace
    seen = []

    def paged_logits(c, s, q, w, table, ctx, fill, maxima, tune):
        n = table.shape[1] * s.page_rows
        seen.append(q.shape[1])
        return (jnp.zeros(ctx.shape + (n,), jnp.float32),
                jnp.zeros(ctx.shape + (workspace.maxima_cols(n),), jnp.uint32))

    stand_in_triton_modules(monkeypatch, prefill_logits=types.SimpleNamespace(paged_logits=paged_logits, PREFILL=None),
                            topk_rows=types.SimpleNamespace(topk_pools=lambda a, l, k, m: ref.topk_pools(a, l, k)))
    bp.main(["--profile", "--prefills", "4096"])
    out = capsys.readouterr().out
    assert "profiled, in order: row top-k 4k first 4096 rows; row top-k 4k last 4096 rows" in out
    assert seen == [4096, 4096]                                 # one chunk holds the whole prompt
    from glm5_jax.config import IndexerConfig
    cfg = IndexerConfig()
    tokens = 40000
    layout, _, table, _, _ = bp.read_case(cfg, 1, tokens)
    q8, w = jnp.zeros((1, tokens, 1, 1)), jnp.zeros((1, tokens, 1))
    rows = workspace.rows_per_chunk(tokens, addr.pools_in_pages(layout.strides(0), table.shape[1]), cfg.topk_pools)
    assert rows < tokens                                        # two chunks or more
    for last, lo in ((False, 0), (True, tokens - rows)):
        got_rows, q, ww, ctx = bp.chunk_rows(cfg, layout, table, q8, w, last)
        assert got_rows == rows and q.shape[1] == ww.shape[1] == rows
        np.testing.assert_array_equal(np.asarray(ctx[0]), (np.arange(lo, lo + rows) + 1) // cfg.kpool)


def test_bench_prefill_times_the_chained_implementations_per_call(monkeypatch):
    """bench_prefill.py --chained: each named implementation also goes through
    time_read (CHAINED_CALLS dependent calls in one jit, the cache fixed, the positions
    perturbed) with the same select_tokens call as its wall-time row; that row carries
    no ratio against the other implementations' single calls, and an implementation
    not named gets no such row."""
    import bench_prefill as bp
    from glm5_jax.config import IndexerConfig

    chained_calls = []

    def time_read(f, args, reps=10, trials=5, fixed=0, perturb=None):
        chained_calls.append(dict(f=f, args=args, reps=reps, fixed=fixed, perturb=perturb))
        return 2e-3

    walled = []
    monkeypatch.setattr(bp, "wall", lambda f, *a, trials=3: walled.append((f, a)) or 1e-3)
    monkeypatch.setattr(bp, "time_read", time_read)
    out = bp.bench_prefill(IndexerConfig(), 64, ["pallas", "xla"], 1e12, True, chained=["xla"])
    assert [r["impl"] for r in out] == ["pallas", "xla", f"xla, {bp.CHAINED_CALLS} calls chained in one jit"]
    assert out[2]["ms"] == 2.0 and out[2]["vs_xla"] is None and out[2]["vs_pallas"] is None
    assert out[1]["vs_pallas"] == 1.0
    (c,) = chained_calls
    assert c["reps"] == bp.CHAINED_CALLS and c["fixed"] == 1 and c["perturb"] == (4,)
    cache, q8, w, table, pos = c["args"]
    assert pos.shape == (1, 64) and pos.dtype == jnp.int32
    assert c["f"].keywords == {"impl": "xla"}
    f, a = walled[1]                                        # the xla row's call
    np.testing.assert_array_equal(np.asarray(jax.jit(c["f"])(*c["args"])), np.asarray(f(*a)))
    with pytest.raises(SystemExit):                         # a misspelt name is refused, not skipped
        bp.main(["--quick", "--chained", "tritn"])


@pytest.mark.parametrize("maxima", [True, False])
def test_bench_prefill_logits_pages_reach_select_tokens_and_the_chunks(monkeypatch, maxima):
    """bench_prefill.py --logits-pages: select_tokens' prefill chunks launch the logits
    kernel with ``prefill_logits.PREFILL`` as it stands when select_tokens is traced, so
    every value compared reaches the kernel, through select_tokens (with and without the
    maxima the row top-k may take) and through the first and last chunk's own calls;
    the module's value is restored after, also when the ids of two values differ, which
    stops the comparison; each entry gives one row of the table. The Triton modules are
    stand-ins here (logits of the kernel's shapes, the reference's top-k), so the CPU
    runs ops' Triton frame."""
    import dataclasses
    import types

    import bench_prefill as bp
    from glm5_jax import ops
    from glm5_jax import reference as ref
    from glm5_jax.config import IndexerConfig
    from pallas_kernels.read import workspace

    @dataclasses.dataclass(frozen=True)
    class Tuning:
        pages: int = 64

    seen, differ = [], []

    def paged_logits(c, s, q, w, table, ctx, fill, maxima=False, tune=None, first_row=None):
        seen.append((tune.pages, maxima))
        n = table.shape[1] * s.page_rows
        cols = jnp.arange(n, dtype=jnp.float32)
        lg = jnp.broadcast_to(-cols if tune.pages in differ else cols, ctx.shape + (n,))
        return (lg, jnp.zeros(ctx.shape + (workspace.maxima_cols(n),), jnp.uint32)) if maxima else lg

    logits = types.SimpleNamespace(PREFILL=Tuning(), paged_logits=paged_logits)
    rows = types.SimpleNamespace(DEFAULT=None, needs_maxima=lambda n_cols, tune: maxima,
                                 topk_pools=lambda a, l, k, m=None, tune=None, order="score": (
                                     ref.topk_pools(a, l, k) if order == "score"
                                     else ref.pool_order(ref.topk_pools(a, l, k))))
    stand_in_triton_modules(monkeypatch, prefill_logits=logits, topk_rows=rows, split_topk=types.SimpleNamespace())
    monkeypatch.setattr(ops._triton, "require", lambda op: None)
    monkeypatch.setattr(ops._expand, "expand_pools", lambda ids, seq, r, interpret=None: ref.expand_pools(ids, seq, r))
    monkeypatch.setattr(bp, "wall", lambda f, *a, trials=3: float(jax.block_until_ready(f(*a)) is not None) * 1e-3)
    out = bp.bench_logits_pages(IndexerConfig(), 256, 1e12, [64, 128])
    # select_tokens (one chunk) per value, then the first chunk's and the last chunk's calls
    assert seen == [(64, maxima), (128, maxima)] * 3
    assert logits.PREFILL == Tuning()
    what = "logits + maxima" if maxima else "logits"
    assert [r["impl"] for r in out] == [
        "select_tokens, logits pages 64", "select_tokens, logits pages 128",
        f"first 256 rows: {what}, pages 64", f"first 256 rows: {what}, pages 128",
        f"last 256 rows: {what}, pages 64", f"last 256 rows: {what}, pages 128"]
    assert all(r["kind"] == "logits-pages" and r["ms"] > 0 for r in out)
    assert all(("x_matmul" in r) == r["impl"].startswith("select_tokens") for r in out)
    differ.append(128)                                  # other logits, other ids: the comparison stops
    with pytest.raises(AssertionError, match="PREFILL = logits pages 128 differs from logits pages 64"):
        bp.bench_logits_pages(IndexerConfig(), 256, 1e12, [64, 128])
    assert logits.PREFILL == Tuning()
    with pytest.raises(SystemExit):                     # repeated or not powers of two: refused before any run
        bp.main(["--logits-pages", "64", "64"])
    with pytest.raises(SystemExit):
        bp.main(["--logits-pages", "48"])
