"""The one Triton-side address operation, (row, col) of the word view -> flat word index,
and the one rule for a query row's extent, its position -> the tokens it sees.

Every block, page, ring and pool offset is computed in JAX by
``pallas_kernels.core.addressing`` and handed to the kernels as int32 (row, col) pairs
of the ``u32[rows, VIEW_COLS]`` view (``addressing.split_word``). Kernels only
flatten a pair here, in int64 so that caches past 2**31 words and bytes work,
and then add lane offsets within one entry (0..31 key words, 0..63 ring-row words).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..core.strides import VIEW_COLS as _VIEW_COLS

VIEW_COLS = tl.constexpr(_VIEW_COLS)


@triton.jit
def word_index(row, col):
    """Flat uint32 word index (int64) of (row, col) in the [rows, VIEW_COLS] view."""
    return row.to(tl.int64) * VIEW_COLS + col


@triton.jit
def row_tokens(pos):
    """Tokens a query row at position pos sees: pos + 1, 0 for a padding row (pos < 0);
    ``reference.seq_lens_from_positions``. Its visible pools: row_tokens(pos) // kpool."""
    return tl.maximum(pos + 1, 0)
