"""Does the batch-invariant model side make a jitted call host-synchronous on the GPU?

Usage: python benchmarks/model_sync.py

``glm5_jax.invariant.linear`` contracts in a fixed order with a ``fori_loop`` over
groups of 8 inputs (a while loop in the compiled program). XLA GPU evaluates a
while loop's predicate on the host, so a call with such a loop cannot return before
the device has run it. This times, for x [16, 512] bf16 @ w [512, 512] bf16, ten
calls issued without waiting: the time until the tenth call returns (dispatch)
and until its result is ready (total), for the invariant linear and for jnp.dot.
Dispatch close to total means the host waits on the device during dispatch; it
also prints how many while loops the compiled program has.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import invariant


def measure(f, x, w, calls=10, trials=5):
    y = f(x, w)
    jax.block_until_ready(y)
    disp, tot = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        ys = [f(x + jnp.asarray(i, x.dtype), w) for i in range(calls)]
        t1 = time.perf_counter()
        jax.block_until_ready(ys)
        t2 = time.perf_counter()
        disp.append((t1 - t0) / calls)
        tot.append((t2 - t0) / calls)
    text = jax.jit(f).lower(x, w).compile().as_text()
    return float(np.median(disp)), float(np.median(tot)), text.count(" while(")


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 512)), jnp.bfloat16)
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    print("| call | dispatch us/call | total us/call | dispatch / total | while loops |\n|---|---|---|---|---|")
    for name, f in (("invariant.linear (fori_loop)", jax.jit(invariant.linear)),
                    ("jnp.dot, f32 accumulate", jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)))):
        d, t, loops = measure(f, x, w)
        print(f"| {name} | {d * 1e6:.1f} | {t * 1e6:.1f} | {d / t:.2f} | {loops} |")


if __name__ == "__main__":
    main()
