"""CacheStrides: the explicit stride metadata of ONE layer of the flat cache.

Plain Python ints, frozen and hashable, so it can be a static argument of
``jax.jit`` and of ``pl.pallas_call`` wrappers. Every byte count is in bytes
(``*_bytes``); every word count is in 32-bit words (``*_words``): the flat buffer
is handed to kernels as uint32 words, and every address in this layout is a
multiple of 4 bytes.

Only ``glm5_jax.layout.CacheLayout.strides`` builds these for real caches; the
kernels and the reference turn (strides, slot) into offsets exclusively through
``pallas_kernels.core.addressing``.
"""
from __future__ import annotations

import dataclasses

KEY_BYTES = 128          # one fp8 e4m3 key row (head_dim 128)
SCALE_BYTES = 4          # one fp32 scale
ROW_BYTES = KEY_BYTES + SCALE_BYTES   # 132 bytes of indexer cache per pool
TAIL_ROW_BYTES = 256     # one bf16 row of 128 in the tail ring
WORD_BYTES = 4
# The flat buffer is viewed by kernels as u32[total_words // VIEW_COLS, VIEW_COLS];
# addresses are split into (row, col) so no index ever needs more than 31 bits,
# whatever the size of the cache (see addressing.split_word).
VIEW_COL_BITS = 10
VIEW_COLS = 1 << VIEW_COL_BITS


@dataclasses.dataclass(frozen=True)
class CacheStrides:
    """Where one layer's indexer pages and tail ring live inside the flat buffer."""

    kpool: int                    # R: tokens per pool
    ring: int                     # tail ring slots per request (tokens)
    page_rows: int                # P: pool rows per page
    pages_per_block: int          # pages in one indexer block
    num_blocks: int               # block ids 0 .. num_blocks-1 (0 = null block)
    index_base_bytes: int         # start of this layer's indexer region in the buffer
    index_block_bytes: int        # bytes of one indexer block (= padded tail block stride)
    total_bytes: int              # size of the whole flat buffer (padded)
    # Stride between consecutive tail blocks. The tail of block b ALIASES indexer
    # block b, so this must equal index_block_bytes (the padded stride). It is a
    # field only so that the historical dense-stride bug (docs/semantics.md B1) can be injected
    # on purpose (glm5_jax.layout.with_fault(layout, "dense-tail-stride")) and caught.
    tail_block_stride_bytes: int = -1

    def __post_init__(self):
        if self.tail_block_stride_bytes == -1:
            object.__setattr__(self, "tail_block_stride_bytes", self.index_block_bytes)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CacheStrides.{f.name} must be a non-negative int, got {v!r}")
        if self.kpool < 1 or self.ring < self.kpool or self.ring % self.kpool:
            raise ValueError(f"ring ({self.ring}) must be a positive multiple of kpool ({self.kpool})")
        if self.page_bytes * self.pages_per_block != self.index_block_bytes:
            raise ValueError("index_block_bytes must equal pages_per_block * page_rows * 132")
        if self.tail_block_bytes > self.index_block_bytes:
            raise ValueError(
                f"tail ring ({self.tail_block_bytes} B) larger than an indexer block "
                f"({self.index_block_bytes} B): the tail must alias inside its own block")
        if self.tail_block_stride_bytes % WORD_BYTES or self.tail_block_stride_bytes < self.tail_block_bytes:
            raise ValueError("tail_block_stride_bytes must be word aligned and hold a whole tail block")
        if self.index_base_bytes % WORD_BYTES or self.total_bytes % (WORD_BYTES * VIEW_COLS):
            raise ValueError("buffer offsets must be word aligned and the buffer a multiple of the view row")
        if self.index_base_bytes + self.index_region_bytes > self.total_bytes:
            raise ValueError("layer's indexer region runs past the end of the buffer")
        if self.index_region_bytes // WORD_BYTES >= 2**31 - VIEW_COLS:
            raise ValueError("one layer's indexer region must stay below 8 GiB (31-bit word offsets)")

    @property
    def is_padded_tail_stride(self) -> bool:
        """True for every correct layout; False only under the injected dense-stride fault."""
        return self.tail_block_stride_bytes == self.index_block_bytes

    # ---- derived sizes (bytes) -------------------------------------------------
    @property
    def page_bytes(self) -> int:            # [P x 128 fp8 keys][P x fp32 scales]
        return self.page_rows * ROW_BYTES

    @property
    def pools_per_block(self) -> int:
        return self.page_rows * self.pages_per_block

    @property
    def num_pool_slots(self) -> int:        # pool slots 0 .. num_pool_slots-1 (block 0's never written)
        return self.num_blocks * self.pools_per_block

    @property
    def num_tail_slots(self) -> int:        # tail slots 0 .. num_tail_slots-1 (block 0's never written)
        return self.num_blocks * self.ring

    @property
    def tail_half_bytes(self) -> int:       # K half, then gate half, each ring rows of 256 B
        return self.ring * TAIL_ROW_BYTES

    @property
    def tail_block_bytes(self) -> int:
        return 2 * self.tail_half_bytes

    @property
    def index_region_bytes(self) -> int:
        return self.num_blocks * self.index_block_bytes

    @property
    def total_words(self) -> int:
        return self.total_bytes // WORD_BYTES


@dataclasses.dataclass(frozen=True)
class AttnStrides:
    """Where one layer's attention K/V rows live: the attention region of the flat buffer.

    Block b of the layer holds ``block_size`` K rows of ``kv_row_bytes`` bytes, then
    ``block_size`` V rows, then padding up to ``attn_block_bytes``. A token-granular
    attention slot is ``block * block_size + pos % block_size`` (the same block ids
    as the indexer pages of the request). Built by ``CacheLayout.attn_strides``;
    offsets come only from ``pallas_kernels.core.addressing``.
    """

    block_size: int               # tokens per block
    kv_row_bytes: int             # bytes of one K row (= one V row)
    num_blocks: int
    attn_base_bytes: int          # start of this layer's attention region in the buffer
    attn_block_bytes: int         # bytes of one attention block of this layer
    total_bytes: int              # size of the whole flat buffer (padded)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"AttnStrides.{f.name} must be a non-negative int, got {v!r}")
        if self.block_size < 1 or self.kv_row_bytes < WORD_BYTES or self.kv_row_bytes % WORD_BYTES:
            raise ValueError(f"kv_row_bytes ({self.kv_row_bytes}) must be a positive multiple of 4 "
                             f"and block_size ({self.block_size}) >= 1")
        if 2 * self.block_size * self.kv_row_bytes > self.attn_block_bytes:
            raise ValueError(
                f"attention block too small: {self.block_size} tokens x (K + V) x {self.kv_row_bytes} B = "
                f"{2 * self.block_size * self.kv_row_bytes} B > attn_block_bytes = {self.attn_block_bytes} B")
        if self.attn_base_bytes % WORD_BYTES or self.attn_block_bytes % WORD_BYTES \
                or self.total_bytes % (WORD_BYTES * VIEW_COLS):
            raise ValueError("attention offsets must be word aligned and the buffer a multiple of the view row")
        if self.attn_base_bytes + self.attn_region_bytes > self.total_bytes:
            raise ValueError("layer's attention region runs past the end of the buffer")
        if self.attn_region_bytes // WORD_BYTES >= 2**31 - VIEW_COLS:
            raise ValueError("one layer's attention region must stay below 8 GiB (31-bit word offsets)")

    @property
    def attn_region_bytes(self) -> int:
        return self.num_blocks * self.attn_block_bytes

    @property
    def num_attn_slots(self) -> int:        # valid token slots: 0 .. num_attn_slots-1
        return self.num_blocks * self.block_size

    @property
    def total_words(self) -> int:
        return self.total_bytes // WORD_BYTES
