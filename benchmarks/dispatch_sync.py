"""Which XLA control flow makes a jitted call wait for the device before it returns?

Usage: python benchmarks/dispatch_sync.py

Each case is one jitted program: a chain of matmuls (several ms of device work)
followed by, or wrapped in, one kind of control flow. For each it prints the time
until the call returns to Python and the time until its result is ready, and their
ratio. A ratio near 0 means the call only queued the work (asynchronous dispatch:
the host is free while the device computes); near 1 means the runtime waited for
the device inside the call. The serving step must be in the first group for host
work to overlap the devices (issue 8; ``glm5_jax.serving.sharding.host_waits`` finds the
waiting instructions in a compiled program's text).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

N = 2048 if jax.default_backend() == "gpu" else 256
LINKS = 40


def work(x):                                          # x [N, N] f32 -> same, ~LINKS matmuls
    for _ in range(LINKS):
        x = jnp.tanh(x @ x * (1.0 / N))
    return x


CASES = {
    "plain": lambda x: work(x),
    "where (both branches, select)": lambda x: jnp.where(jnp.sum(x) > 0, work(x), -x),
    "lax.cond after the work, cheap branches": lambda x: lax.cond(jnp.sum(work(x)) > 0, lambda y: y + 1,
                                                                 lambda y: y - 1, x),
    # a branch XLA cannot turn into a select: the predicate needs the first half's work
    "lax.cond between two halves of the work": lambda x: lax.cond(
        jnp.sum(work(x)) > 0, work, lambda y: -y, x * 0.5),
    "fori_loop, static trip count": lambda x: lax.fori_loop(0, LINKS, lambda i, y: jnp.tanh(y @ y * (1.0 / N)), x),
    "fori_loop, static trip count, unroll 8": lambda x: lax.fori_loop(
        0, LINKS, lambda i, y: jnp.tanh(y @ y * (1.0 / N)), x, unroll=8),
    "while_loop, data-dependent": lambda x: lax.while_loop(
        lambda c: c[0] < LINKS, lambda c: (c[0] + jnp.int32(jnp.sum(c[1]) > -1e30), jnp.tanh(c[1] @ c[1] * (1.0 / N))),
        (jnp.int32(0), x))[1],
}


def measure(fn, x, trials=5):
    f = jax.jit(fn)
    jax.block_until_ready(f(x))                       # compile + warm up
    ret, done = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        y = f(x)
        t1 = time.perf_counter()
        jax.block_until_ready(y)
        t2 = time.perf_counter()
        ret.append(t1 - t0)
        done.append(t2 - t0)
    return float(np.median(ret)), float(np.median(done))


def main():
    print(f"dispatch_sync: {jax.default_backend()} {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{LINKS} matmuls of [{N}, {N}]")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((N, N)), jnp.float32)
    print(f"| case | call returns (ms) | result ready (ms) | returns / ready |")
    print(f"|---|---:|---:|---:|")
    for name, fn in CASES.items():
        r, d = measure(fn, x)
        print(f"| {name} | {r * 1e3:.2f} | {d * 1e3:.2f} | {r / d:.2f} |", flush=True)


if __name__ == "__main__":
    main()
