"""The one place that knows which Pallas GPU backend runs the kernels.

Today: ``pl.pallas_call`` lowered by the Pallas Triton backend (deprecated
upstream since JAX 0.11, still shipped in 0.12). Kernel files call only
``pallas_call``, ``load``, ``store``, ``gather``, ``scatter``, ``atomic_add``,
``barrier``, ``table_lookup``, ``kernel_numerics`` and ``resolve_interpret`` from
here, so moving to Mosaic GPU or jax-triton later touches this file and the kernel
bodies' memory ops, not their callers.
"""
from __future__ import annotations

import warnings

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def resolve_interpret(interpret) -> bool:
    """None -> interpret everywhere except on a GPU backend."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def pallas_call(kernel, *, grid, out_shape, input_output_aliases, interpret, name,
                num_warps=4, num_stages=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=out_shape,
            input_output_aliases=input_output_aliases,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=resolve_interpret(interpret),
            name=name,
        )


def narrow_offsets_safe(nbytes: int) -> bool:
    """Whether a kernel input of `nbytes` bytes can be indexed element by element
    at any offset: the Triton lowering computes offsets in i32 unless the input is
    larger than 2**32 bytes, so between 2**31 and 2**32 bytes the elements past
    byte 2**31 of a 1-byte dtype fault (measured on the H200); wider
    dtypes keep their element offsets below 2**31."""
    return nbytes <= 2**31 or nbytes > 2**32


def _bool_mask(mask):
    """`mask`, checked to be boolean. The Triton lowering rejects any other load or store
    mask when it compiles for the GPU, while interpret mode takes an int mask as its truth
    value, so a mask such as ``~False`` (the int -1) would pass on the CPU and fail only
    on the GPU. Checking here makes the CPU tests fail the same way."""
    dtype = getattr(mask, "dtype", type(mask))
    if dtype not in (bool, jax.numpy.bool_):
        raise TypeError(f"a load / store mask must be boolean, got {dtype}")
    return mask


def load(ref, mask=None, other=None):
    """Masked load (masked-out lanes read `other` and touch no memory on the GPU)."""
    if mask is None:
        return ref[...]
    return plt.load(ref, mask=_bool_mask(mask), other=other)


def store(ref, value, mask=None):
    """Masked store: masked-out lanes write nothing."""
    if mask is None:
        ref[...] = value
    else:
        plt.store(ref, value, mask=_bool_mask(mask))


def gather(ref, rows, cols, mask=None, other=0):
    """ref[rows, cols] for equal-shaped int index arrays (masked lanes read `other`)."""
    if mask is None:
        return ref[rows, cols]
    return plt.load(ref.at[rows, cols], mask=_bool_mask(mask), other=other)


def table_lookup(ref):
    """j -> ref[0, j] for int index arrays j: a small constant table passed in as a
    [1, n] kernel input (kernel bodies cannot close over arrays)."""
    return lambda j: gather(ref, jax.numpy.zeros_like(j), j)


def kernel_numerics(tab_ref, interpret: bool) -> dict:
    """The keyword arguments a kernel body gives ``numerics.compress_pool``: its exp table
    lookup and, compiled for an NVIDIA GPU, one PTX instruction for each of the multiply
    (``mul_rn``), the bf16 rounding (``bf16_round_rn``) and the Hadamard's -0 -> +0
    (``plus_zero_rn``), and the fp8 conversion's own saturation in place of the clip.
    Interpret mode and ROCm get the numerics' defaults.

    The pooling's weights stay the four-exp ``numerics.softmax_weights`` here: the
    knockout form (``numerics.softmax_weights_knockout``, three exps and six selects, the
    same bits) makes compression 2 % slower at 32k tokens and 4 % at 128k on the H200
    (docs/benchmarks.md), so only the decode update at next_n 1 takes it
    (``decode_update._knockout_weights``)."""
    return dict(exp_lookup=table_lookup(tab_ref), mul=mul_rn(interpret), bf16_round=bf16_round_rn(interpret),
                zero_plus=plus_zero_rn(interpret), fp8_saturates=_ptx(interpret))


def _ptx(interpret: bool) -> bool:
    """Whether the kernels are compiled for an NVIDIA GPU (PTX inline assembly; the fp8
    conversion is cvt.rn.satfinite)."""
    return not interpret and not _rocm()


def _asm_f32(asm: str, *args, out_bits: bool = False):
    """PTX applied elementwise to f32 operands (broadcast to one shape): an f32 result, or
    with ``out_bits`` a 32-bit integer register read back as the f32 of those bits."""
    jnp = jax.numpy
    args = [jnp.asarray(a, jnp.float32) for a in args]
    shape = jnp.broadcast_shapes(*(a.shape for a in args))
    [out] = plt.elementwise_inline_asm(
        asm, args=[jnp.broadcast_to(a, shape) for a in args],
        constraints=("=r" if out_bits else "=f") + ",f" * len(args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32 if out_bits else jnp.float32)])
    return jax.lax.bitcast_convert_type(out, jnp.float32) if out_bits else out


def mul_rn(interpret: bool):
    """The kernels' separately rounded f32 multiply (``numerics.mul_rounded``'s contract),
    as the ``mul`` that the numerics functions take; None (their default) in interpret
    mode and on ROCm.

    Compiled for an NVIDIA GPU it is one ``mul.rn.f32`` of inline PTX: ptxas never fuses
    a multiply that names its rounding mode into an FMA, and LLVM does not look into
    inline assembly, so no compiler setting can contract it, and the integer min that
    ``numerics.rounded`` needs for that elsewhere is gone. Both are the correctly rounded
    product: the same bits for every product that is not a NaN (the GPU write tests hold
    the kernels to the XLA reference byte for byte).
    """
    if not _ptx(interpret):
        return None
    return lambda a, b: _asm_f32("mul.rn.f32 $0, $1, $2;", a, b)


def bf16_round_rn(interpret: bool):
    """The kernels' ``numerics.round_bf16`` (nearest bf16, ties to even, as f32), or None
    (its integer form) in interpret mode and on ROCm.

    Compiled for an NVIDIA GPU it is one ``cvt.rn.bf16x2.f32`` that packs the rounded
    value into the high half of a register and +0 into the low half: that register is the
    f32 of the rounded value: one instruction for the integer form's four, with the same
    bits for every input that is not a NaN (finite, infinite, subnormal; tests/test_gpu.py).
    A NaN input may come out as another NaN pattern.
    """
    if not _ptx(interpret):
        return None
    return lambda x: _asm_f32("{ .reg .f32 z; mov.f32 z, 0f00000000; cvt.rn.bf16x2.f32 $0, $1, z; }", x,
                              out_bits=True)


def plus_zero_rn(interpret: bool):
    """The kernels' ``numerics.positive_zero`` (-0 -> +0, all else unchanged), or None in
    interpret mode and on ROCm: compiled for an NVIDIA GPU, one ``add.rn.f32 x, +0`` (IEEE:
    -0 + +0 = +0, x + +0 = x otherwise; inline assembly, so nothing folds it away) in
    place of a compare and a select."""
    if not _ptx(interpret):
        return None
    return lambda x: _asm_f32("add.rn.f32 $0, $1, 0f00000000;", x)


def _rocm() -> bool:
    """Whether the GPU is AMD's (no PTX). Without a GPU, compiled kernels can only be
    lowered for CUDA (benchmarks/offline_sass.py), so that counts as NVIDIA."""
    try:
        dev = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        return False
    return "rocm" in getattr(dev.client, "platform_version", "").lower()


def scatter(ref, rows, cols, value, mask):
    """ref[rows, cols] = value where mask, for equal-shaped int index arrays.

    Masked-out lanes are parked on row ``ref.shape[0]`` (past the end): the GPU
    never touches them (masked), and interpret mode drops out-of-range scatters
    instead of writing the old value back over a real write to the same address.
    """
    rows = jax.numpy.where(_bool_mask(mask), rows, ref.shape[0])
    plt.store(ref.at[rows, cols], value, mask=mask)


def barrier(interpret: bool):
    """Block-wide barrier: orders this program's global writes before its later reads.

    Interpret mode runs a program's ops in order, so it needs (and has) none.
    """
    if not interpret:
        plt.debug_barrier()


ds = pl.ds
program_id = pl.program_id
when = pl.when


def atomic_add(ref, idx, value):
    """ref[idx] += value atomically (scalar idx and value); returns the value before.

    Unmasked only: interpret mode has no masked atomics. Programs that share a
    counter see its updates in some order, so callers must not depend on it."""
    return plt.atomic_add(ref, idx, value)
