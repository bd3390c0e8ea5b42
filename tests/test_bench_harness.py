"""The benchmark harnesses must time every chained call: XLA deletes calls whose
output nobody reads and merges identical ones, which once made a harness time one
call and divide by ten."""
import sys
import pathlib

import jax
import jax.numpy as jnp

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
    import pytest
    with pytest.raises(ValueError, match="perturb"):
        br.time_read(f, args, reps=2, trials=1, perturb=(0, 2))


def test_offline_sass_captures_each_kernel():
    """benchmarks/offline_sass.py reads each Pallas kernel's Triton IR out of jax's
    CUDA lowering (on this CPU, through jax internals that may move): one module per
    kernel of the op, in launch order, with its name and launch parameters."""
    import offline_sass as osass
    from pallas_kernels import topk as tk
    x = jnp.zeros((8, 8192), jnp.float32)
    got = osass.capture(lambda x, l: tk.topk_pools(x, l, 64, interpret=False), x, jnp.full((8,), 8192, jnp.int32))
    assert [g[0] for g in got] == ["kpool_topk_maxima", "kpool_topk_floor", "kpool_topk_filter",
                                   "kpool_topk_select", "kpool_topk_fallback"]
    assert [g[1] for g in got] == [4, tk.ROW_WARPS, 8, 4, 4]
    assert all("tt.func" in g[3] for g in got)
