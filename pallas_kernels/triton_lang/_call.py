"""jax_triton glue: can the Triton kernels run here, and the one ``triton_call`` wrapper.

Nothing in this file imports ``triton`` or ``jax_triton`` at module level, so the
availability check (and its clear error) works on any machine. ``jax_triton``
registers its lowering for CUDA and ROCm only: there is no CPU or interpret
path, so CPU runs (and CI) use ``implementation="pallas"`` (interpret mode) or
``"xla"`` instead.

The launches: jax_triton compiles each kernel and packs the launch (the compiled
kernel, grid, parameters) into jaxlib's ``TritonKernelCall``; jax-triton 0.3.1 then
emits it as jaxlib's legacy custom call ``triton_kernel_call``, which XLA runs with
host work per launch and outside its command buffers (about 1 us between launches).
Our calls on CUDA leave as ``FFI_TARGET`` instead, jaxlib's typed-FFI form of the same
call: ``_lower`` lets jax_triton build the call and re-emits its serialized launch
under that target, so XLA captures it in command buffers like the kernels around it.
Other callers of jax_triton in the process keep jax_triton's own lowering, and a
jax-triton of another series than ``WRAPPED_JAX_TRITON`` launches its own way.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

JAX_TRITON_PIN = "jax-triton==0.3.1"   # the version run on the GPU image (jax 0.11.2, triton 3.6.0)


class TritonUnavailableError(RuntimeError):
    """``implementation="triton"`` was requested where it cannot run."""


@functools.lru_cache(maxsize=None)
def _import_error() -> str | None:
    """None if ``triton`` and ``jax_triton`` import, else why not (cached per process)."""
    try:
        import triton  # noqa: F401
        import jax_triton  # noqa: F401
    except Exception as e:          # ImportError; jax_triton raises it without a GPU jaxlib
        return f"{type(e).__name__}: {e}".strip()
    return None


def _backend() -> str:
    return jax.default_backend()


def unavailable_reason() -> str | None:
    """None when the Triton kernels can run in this process, else a one-line reason."""
    backend = _backend()
    if backend != "gpu":
        return (f"no GPU backend (jax.default_backend() is {backend!r}); jax_triton compiles "
                f"for CUDA/ROCm only and has no CPU or interpret mode")
    err = _import_error()
    if err is not None:
        return (f"jax_triton is not importable ({err}); install the extra "
                f"`pip install 'glm5-jax[triton]'` ({JAX_TRITON_PIN}, triton>=3.6)")
    return None


def available() -> bool:
    return unavailable_reason() is None


def require(op: str) -> None:
    """Raise TritonUnavailableError naming `op` and the reason, unless the kernels can run."""
    reason = unavailable_reason()
    if reason is not None:
        raise TritonUnavailableError(f"{op}: implementation='triton' is unavailable: {reason}; "
                                     f"use implementation='pallas' (interpret mode off the GPU) or 'xla'")


# jaxlib's typed-FFI Triton launch (jaxlib > 0.10.2): one attribute, "opaque", the
# zlib-compressed TritonKernelCall proto that the legacy target takes as its backend config
FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
WRAPPED_JAX_TRITON = (0, 3)      # the jax-triton series whose lowering _lower wraps (JAX_TRITON_PIN)


def _ffi_target_available() -> bool:
    from jax._src.lib import version as jaxlib_version
    return tuple(jaxlib_version) > (0, 10, 2)


def _lower(jax_triton_rule, ffi: bool, ctx, *array_args, **params):
    """Lowering of jax_triton's primitive. A call naming FFI_TARGET is built by jax_triton
    under the legacy target (compiled kernel, serialized launch); with ``ffi`` (CUDA) its
    launch is re-emitted as the typed-FFI custom call, without (ROCm, not measured) the
    legacy call stays. Any other call is jax_triton's own."""
    if params.get("custom_call_target_name") != FFI_TARGET:
        return jax_triton_rule(ctx, *array_args, **params)
    from jax._src.lib.mlir import ir
    legacy = jax_triton_rule(ctx, *array_args, **{**params, "custom_call_target_name": LEGACY_TARGET})
    if not ffi or not legacy:
        return legacy
    op = legacy[0].owner
    op = getattr(op, "operation", op)
    try:
        config = ir.StringAttr(op.attributes["backend_config"])
    except ValueError:                                       # not the serialized launch: leave it be
        return legacy
    out = jax.ffi.ffi_lowering(FFI_TARGET, operand_output_aliases=dict(params["input_output_aliases"]))(
        ctx, *array_args, opaque=config.value_bytes)
    op.erase()                                               # its results are not used
    return out


@functools.lru_cache(maxsize=None)
def call_target() -> str | None:
    """The custom-call target our launches name: FFI_TARGET where this jaxlib has it and
    jax_triton is of the series ``_lower`` wraps (registering ``_lower`` for jax_triton's
    primitive once per process, for CUDA and ROCm), else None (jax_triton's own launch)."""
    import jax_triton
    from jax.interpreters import mlir
    from jax_triton import triton_lib
    if not _ffi_target_available() or tuple(jax_triton.__version_info__[:2]) != WRAPPED_JAX_TRITON:
        return None
    for platform, backend, ffi in (("cuda", triton_lib.get_cuda_backend, True),
                                   ("rocm", triton_lib.get_hip_backend, False)):
        rule = functools.partial(triton_lib.triton_kernel_call_lowering, backend)
        mlir.register_lowering(triton_lib.triton_kernel_call_p, functools.partial(_lower, rule, ffi),
                               platform=platform)
    return FFI_TARGET


def _target_kwargs() -> dict:
    target = call_target()
    return {} if target is None else dict(custom_call_target_name=target)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*scalars, *arrays, cache_out, **constexprs)``.

    ``arrays[cache_index]`` is the flat uint32 cache; its output aliases it.
    ``scalars`` are int32 sizes (token / completion counts) passed at run time, so a
    kernel compiles once per set of constexprs, not once per batch shape. Kernel
    files build a Launch (``plan``) and ``run`` hands it to jax_triton; the
    interpreter dev script (tests/scripts/triton_dev_check.py) runs the same Launch
    with Triton's CPU interpreter, so both see the same arguments and grid.
    """
    kernel: Any
    arrays: tuple
    cache_index: int
    grid: tuple
    num_warps: int
    name: str
    constexprs: dict
    scalars: tuple = ()
    # Triton's enable_fp_fusion (mul + add -> FMA). Off: the bytes must not depend on
    # the compiler's choices (numerics_tl.py); a GPU test also runs it on.
    fp_fusion: bool = False

    def __post_init__(self):
        for k, v in self.constexprs.items():
            if k.startswith("TILE") and (not isinstance(v, int) or v < 1 or v & (v - 1)):
                raise ValueError(f"{self.name}: {k} must be a power of two (a Triton block shape), got {v!r}")
        if not isinstance(self.num_warps, int) or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{self.name}: num_warps must be a power of two, got {self.num_warps!r}")
        for i, a in enumerate(self.arrays):
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise TypeError(f"{self.name}: array argument {i} must be an array, got {type(a).__name__}")
        for v in self.scalars:
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**31:
                raise TypeError(f"{self.name}: scalar arguments must be int32 sizes, got {v!r}")


def run(launch: Launch):
    """Run `launch` through ``jax_triton.triton_call``; returns the new cache.

    The cache's output aliases its input (``input_output_aliases``), so under a jit
    that donates the cache XLA neither copies nor reallocates it. jax_triton passes
    the output pointer after all inputs: kernels take ``(..., cache_in, cache, ...)``
    and read and write through ``cache`` only. The alias index counts array
    operands only (jax_triton passes scalars as kernel parameters, not operands).
    """
    import jax_triton as jt
    cache = launch.arrays[launch.cache_index]
    return jt.triton_call(
        *launch.scalars,
        *launch.arrays,
        kernel=launch.kernel,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        grid=launch.grid,
        input_output_aliases={launch.cache_index: 0},
        name=launch.name,
        num_warps=launch.num_warps,
        num_stages=1,
        enable_fp_fusion=launch.fp_fusion,
        **_target_kwargs(),
        **launch.constexprs,
    )


def run_read(kernel, scalars: tuple, arrays: tuple, out_shape, *, grid: tuple, num_warps: int, num_stages: int,
             name: str, constexprs: dict, input_output_aliases: dict | None = None):
    """Run a read kernel (no cache written) through ``jax_triton.triton_call``: the
    scalars (int32 sizes, kernel parameters), the array operands, then the outputs
    `out_shape` (one ShapeDtypeStruct or a tuple). Returns the output(s)."""
    import jax_triton as jt
    for v in scalars:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**31:
            raise TypeError(f"{name}: scalar arguments must be int32 sizes, got {v!r}")
    return jt.triton_call(*scalars, *arrays, kernel=kernel, out_shape=out_shape, grid=grid,
                          input_output_aliases=input_output_aliases or {}, name=name, num_warps=num_warps,
                          num_stages=num_stages, **_target_kwargs(), **constexprs)
