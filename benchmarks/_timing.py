"""Timing helpers shared by the benchmark scripts (GPU first; they run on CPU too).

Kernels are timed inside jitted programs that chain many calls, the cache
threaded through and donated; the time per call is the difference between a
long and a short chain over the difference of their lengths, so it is device
time per call (launch included), without the fixed cost of dispatching a jit. Reported numbers are ratios against baselines
measured in the same run: device-to-device copy bandwidth, an empty Pallas
launch, the XLA reference.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


SHORT_FRACTION = 5         # the short chain has reps // SHORT_FRACTION calls (at least 1)


def _chain(step, reps):
    @functools.partial(jax.jit, donate_argnums=0)
    def chain(s, *a):
        for _ in range(reps):
            s = step(s, *a)
        return s
    return chain


def _median_seconds(chain, state, args, trials):
    state = chain(state, *args)             # compile + warm up
    jax.block_until_ready(state)
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        state = chain(state, *args)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), state


def short_reps(reps: int) -> int:
    """Length of time_chain's short chain for a long chain of `reps` calls."""
    return max(1, reps // SHORT_FRACTION)


def time_chain(step, state, *args, reps=20, trials=5):
    """Device seconds per call of `state = step(state, *args)`: the cost of ONE MORE call
    in a chain of calls inside one jit, the state threaded through and donated.

    Two chains are timed, of reps and reps // SHORT_FRACTION calls (median of
    `trials` runs each); the result is the difference of the two times over the
    difference of their lengths. That cancels what a jit call costs once, whatever
    its length (Python dispatch, argument handling, the final synchronisation:
    ~40-60 us on the H200, which a 20-call chain spread as 2-3 us over every call:
    more than an empty kernel launch). The chains are unrolled, and XLA compiles
    every Pallas call of them separately (~1 s each), so the two chains together
    hold only ~1.2 x reps calls. If noise makes the long chain no slower than the
    short one (CPU smoke runs), the long chain's time per call is returned instead
    (an upper bound). Returns (seconds per call, the final state).
    """
    lo = short_reps(reps)
    if reps <= lo:
        raise ValueError(f"time_chain needs reps > {lo}, got {reps}")
    short, state = _median_seconds(_chain(step, lo), state, args, trials)
    long_, state = _median_seconds(_chain(step, reps), state, args, trials)
    t = (long_ - short) / (reps - lo)
    return (t if t > 0 else long_ / reps), state


def chain_cache_copies(step, state, *args, reps=3):
    """How many copies of the state (>= half its bytes) XLA put into the compiled chain.

    0 means every call updates the donated state in place; n > 0 means the timing
    of `time_chain` includes n full copies per `reps` calls (not kernel time).
    """
    import re

    @functools.partial(jax.jit, donate_argnums=0)
    def chain(s, *a):
        for _ in range(reps):
            s = step(s, *a)
        return s

    text = chain.lower(state, *args).compile().as_text()
    nbytes = state.size * state.dtype.itemsize
    width = {"u8": 1, "s8": 1, "u16": 2, "s16": 2, "bf16": 2, "f16": 2, "u32": 4, "s32": 4, "f32": 4}
    n = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^ ]* copy\(", text):
        size = int(np.prod([int(d) for d in m.group(2).split(",") if d])) * width.get(m.group(1), 8)
        n += size * 2 >= nbytes
    return n


def copy_bandwidth(nbytes=1 << 30):
    """Device-to-device copy bandwidth in bytes/s (read + write counted), measured now."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)

    def step(s):                          # reads and writes every word once; the barrier
        return jax.lax.optimization_barrier(s + jnp.uint32(1))   # stops XLA fusing the chain
    t, _ = time_chain(step, x, reps=10)
    return 2 * nbytes / t


def _empty_kernel(x_ref, o_ref):
    pass


def empty_launch_seconds():
    """Seconds per call of an empty Pallas kernel (one program) chained in one jit."""
    from pallas_kernels import _backend as B
    x = jnp.zeros((1024,), jnp.uint32)

    def step(s):
        return B.pallas_call(_empty_kernel, grid=(1,), out_shape=jax.ShapeDtypeStruct(s.shape, s.dtype),
                             input_output_aliases={0: 0}, interpret=None, name="empty", num_warps=1)(s)
    t, _ = time_chain(step, x, reps=20)
    return t
