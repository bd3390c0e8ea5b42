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
