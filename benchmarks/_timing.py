"""Timing helpers shared by the benchmark scripts (GPU first; they run on CPU too).

Kernels are timed inside ONE jitted program that chains `reps` calls, the cache
threaded through and donated, so the time is device time per call (launch
included) plus 1/reps of one jit dispatch (reps = 100 for latency-bound kernels). Reported numbers are ratios against baselines
measured in the same run: device-to-device copy bandwidth, an empty Pallas
launch, the XLA reference.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def _chain(step, reps):
    @functools.partial(jax.jit, donate_argnums=0)
    def chain(s, *a):
        for _ in range(reps):
            s = step(s, *a)
        return s
    return chain


def time_chain(step, state, *args, reps=20, trials=5):
    """Seconds per call of `state = step(state, *args)` chained `reps` times in ONE jit
    (the state threaded through and donated): median over `trials` of the chain's
    time / reps. Returns (seconds per call, the final state).

    The time includes 1/reps of what dispatching the jit costs once (~40-60 us on
    the H200): with reps = 20 that is 2-3 us per call, more than an empty kernel
    launch, so latency-bound kernels are timed with reps = 100 (<= 0.6 us). The
    difference of a short and a long chain is no way around it: at 2 vs 10 calls it
    gives impossible values (calls below an empty launch).
    """
    chain = _chain(step, reps)
    state = chain(state, *args)             # compile + warm up
    jax.block_until_ready(state)
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        state = chain(state, *args)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / reps)
    return float(np.median(times)), state


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


def empty_launch_step(s):
    """s -> s through an empty Pallas kernel of one program (s aliased, nothing written)."""
    from pallas_kernels.core import backend as B
    return B.pallas_call(_empty_kernel, grid=(1,), out_shape=jax.ShapeDtypeStruct(s.shape, s.dtype),
                         input_output_aliases={0: 0}, interpret=None, name="empty", num_warps=1)(s)


def empty_grid_step(programs: int, num_warps: int):
    """s -> s through an empty Pallas kernel of `programs` programs of `num_warps` warps:
    the launch floor of a kernel with that grid (the decode update's: one program per
    request)."""
    from pallas_kernels.core import backend as B

    def step(s):
        return B.pallas_call(_empty_kernel, grid=(programs,), out_shape=jax.ShapeDtypeStruct(s.shape, s.dtype),
                             input_output_aliases={0: 0}, interpret=None, name="empty_grid",
                             num_warps=num_warps)(s)
    return step


def empty_launch_seconds():
    """Seconds per call of an empty Pallas kernel (one program) chained in one jit."""
    t, _ = time_chain(empty_launch_step, jnp.zeros((1024,), jnp.uint32), reps=100)
    return t


def cudart():
    """libcudart of the CUDA pip wheels JAX uses (or the system one); None if absent."""
    try:
        import nvidia
    except ImportError:                                   # no CUDA wheels (CPU machine)
        return None
    pats = [os.path.join(p, "**", "libcudart.so*") for p in nvidia.__path__]
    for path in sorted(sum((glob.glob(p, recursive=True) for p in pats), [])) + ["libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def threaded(f, state, *args):
    """A call for ``profile_calls``: ``state = f(state, *args)`` on the state the previous
    call returned (f jitted with the state donated)."""
    box = [state]

    def call():
        box[0] = f(box[0], *args)
        return box[0]
    return call


def profile_calls(calls) -> list:
    """For Nsight Compute (``ncu --profile-from-start off``): run each (name, call) of
    `calls` once (compile and warm up), then each once more between cudaProfilerStart and
    cudaProfilerStop, so ncu sees exactly the kernels of those calls, in order. Off the
    GPU (no libcudart) the calls still run, without a profiler range. Prints and returns
    the names in the order profiled."""
    for _, call in calls:
        jax.block_until_ready(call())
    lib = cudart()
    if lib is not None:
        lib.cudaProfilerStart()
    for _, call in calls:
        jax.block_until_ready(call())
    if lib is not None:
        lib.cudaProfilerStop()
    names = [n for n, _ in calls]
    print("profiled, in order:", "; ".join(names), "" if lib is not None else "(no libcudart: no profiler range)")
    return names
