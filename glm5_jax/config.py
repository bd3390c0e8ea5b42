"""IndexerConfig: GLM-5.3-Flash indexer constants and the geometry derived from them."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from pallas_kernels.core.strides import ROW_BYTES, TAIL_ROW_BYTES, VIEW_COLS, WORD_BYTES

MAX_HEADS = 64                      # the logits kernels take 32 or 64 (zero-padded) heads
# One layer's indexer region must stay below 2**31 - VIEW_COLS words (31-bit layer-local
# offsets, addressing.split_word), and a layout holds at least 2 blocks.
MAX_REGION_WORDS = 2**31 - VIEW_COLS


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def checked_int(owner: str, name: str, value) -> int:
    """`value` as a Python int: an int or a numpy integer. A bool, a float (even a
    whole one) or anything else is a ValueError naming `owner.name`, the value and its type."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """Model constants of the kpool indexer (docs/semantics.md 0) plus derived geometry.

    Defaults are GLM-5.3-Flash's: head_dim 128, 32 indexer heads, pools of 4
    tokens, top-2048 tokens, manager blocks of 1152 tokens, no speculative tokens.
    Every field is an int (numpy integers are taken as ints; bools and floats are
    refused). An impossible combination raises ValueError naming the rule it breaks:
    head_dim == 128; 1 <= n_heads <= 64; kpool >= 1; topk a positive multiple of kpool;
    block_size a positive multiple of kpool (of kpool * 32 above 64 pools per block),
    divisible by the ring, with two blocks' indexer pages below 8 GiB; num_spec_tokens
    >= 0 with the tail ring inside one indexer block.
    """

    head_dim: int = 128
    n_heads: int = 32
    kpool: int = 4
    topk: int = 2048
    block_size: int = 1152          # tokens per manager block
    num_spec_tokens: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, checked_int("IndexerConfig", f.name, getattr(self, f.name)))
        if self.head_dim != 128:
            raise ValueError(f"head_dim must be 128 (the Hadamard-128 rotation and the 132-byte "
                             f"cache row are fixed), got {self.head_dim}")
        if not 1 <= self.n_heads <= MAX_HEADS:
            raise ValueError(f"n_heads must be in [1, {MAX_HEADS}] (the logits take 32 or 64 zero-padded "
                             f"heads), got {self.n_heads}")
        if self.kpool < 1:
            raise ValueError(f"kpool must be >= 1, got {self.kpool}")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        if self.topk < self.kpool or self.topk % self.kpool:
            raise ValueError(f"topk ({self.topk}) must be a positive multiple of kpool ({self.kpool})")
        if self.block_size < 1 or self.block_size % self.kpool:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of kpool ({self.kpool})")
        if 2 * self.index_block_bytes // WORD_BYTES >= MAX_REGION_WORDS:
            raise ValueError(f"block_size ({self.block_size}) too large: an indexer block of "
                             f"{self.index_block_bytes} B leaves no room for the 2 blocks a layout needs in "
                             f"one layer's indexer region (below 8 GiB)")
        s = self.pools_per_block
        if s > 64 and s % 32:
            raise ValueError(
                f"block_size ({self.block_size}) must be a multiple of kpool*32 = {self.kpool * 32} "
                f"when a block holds more than 64 pools ({s}): pages are 64 or 32 pool rows")
        if self.tail_block_bytes > self.index_block_bytes:
            raise ValueError(
                f"tail ring larger than an indexer block: 2*ring*256 = {self.tail_block_bytes} B > "
                f"index_block_bytes = {self.index_block_bytes} B (the tail must alias inside its block)")
        if self.block_size % self.ring:
            raise ValueError(f"ring ({self.ring}) must divide block_size ({self.block_size})")

    # ---- derived geometry ------------------------------------------------------
    @property
    def pools_per_block(self) -> int:          # S = block_size / kpool
        return self.block_size // self.kpool

    @property
    def page_rows(self) -> int:                # P: S if S <= 64, else 64 if S % 64 == 0, else 32
        s = self.pools_per_block
        return s if s <= 64 else (64 if s % 64 == 0 else 32)

    @property
    def pages_per_block(self) -> int:
        return self.pools_per_block // self.page_rows

    @property
    def page_bytes(self) -> int:
        return self.page_rows * ROW_BYTES

    @property
    def index_block_bytes(self) -> int:        # S * 132
        return self.pools_per_block * ROW_BYTES

    @property
    def ring(self) -> int:                     # kpool * next_pow2(ceil((kpool + n_spec) / kpool))
        return self.kpool * next_pow2(math.ceil((self.kpool + self.num_spec_tokens) / self.kpool))

    @property
    def tail_block_bytes(self) -> int:         # K half + gate half
        return 2 * self.ring * TAIL_ROW_BYTES

    @property
    def tail_block_stride_elems(self) -> int:  # padded tail stride(0) in bf16 elements
        return self.index_block_bytes // 2

    @property
    def topk_pools(self) -> int:
        return self.topk // self.kpool

    @property
    def index_width(self) -> int:              # topk + kpool - 1 columns per query row
        return self.topk + self.kpool - 1

    @property
    def index_bytes_per_token(self) -> float:  # 132 / kpool per layer
        return ROW_BYTES / self.kpool
