"""The ONLY place that turns (strides, slot) into buffer offsets.

Everything here works on Python ints, numpy arrays and traced jax int32 arrays
alike (inside Pallas kernels too), so the kernels, the XLA reference, the
inspection views and the tests all address the buffer through the same lines.

Units: a *pool slot* (``loc``) is pool-granular and layer-local; a *tail slot*
(``tslot``) is token-granular: ``tail_block * ring + pos % ring``. Block 0 is the
null block (padded page tables point at it): no slot inside it is writable, and
``pool_slot_valid`` / ``tail_slot_valid`` are the one rule every writer masks by. Offsets are in
32-bit words (``*_words``). Offsets returned by the ``*_words`` functions are
local to the layer's indexer region and always < 2**31; ``split_word`` adds the
layer base and splits the global word address into (row, col) of the
``u32[total_words // VIEW_COLS, VIEW_COLS]`` view, so no index ever needs 64 bits
(the Triton backend then computes the 64-bit pointer itself for caches > 4 GiB).
"""
from __future__ import annotations

from .strides import (CacheStrides, KEY_BYTES, TAIL_ROW_BYTES, VIEW_COL_BITS, VIEW_COLS,
                      WORD_BYTES)

KEY_WORDS = KEY_BYTES // WORD_BYTES            # 32 words = 128 fp8 bytes
TAIL_ROW_WORDS = TAIL_ROW_BYTES // WORD_BYTES  # 64 words = 128 bf16


def view_shape(s: CacheStrides) -> tuple[int, int]:
    """Shape of the 2-D uint32 view the kernels index: [rows, VIEW_COLS]."""
    return (s.total_words // VIEW_COLS, VIEW_COLS)


def byte_view_shape(s: CacheStrides) -> tuple[int, int]:
    """Shape of the 2-D uint8 view of the same buffer (read-only kernels; an XLA
    bitcast of the word view, no copy): [rows, 4 VIEW_COLS], the same rows, so byte
    4 c + t of a row is byte t of word c."""
    return (s.total_words // VIEW_COLS, VIEW_COLS * WORD_BYTES)


# ---- pool slots (indexer K cache) ----------------------------------------------
def pool_slot_valid(s: CacheStrides, loc):
    """A pool slot writes only if it lies in a block 1 .. num_blocks - 1:
    pools_per_block <= loc < num_blocks * pools_per_block. Block 0 is the null block,
    so its slots are ignored like padding (-1) and slots past the last block."""
    return (loc >= s.pools_per_block) & (loc < s.num_pool_slots)


def pool_page_row(s: CacheStrides, loc):
    """(page, row) of a pool slot: page = loc // P, row = loc % P (loc >= 0)."""
    return loc // s.page_rows, loc % s.page_rows


def pool_slot(s, page, row):
    """Pool slot of row `row` of page `page`: page * P + row (the inverse of
    ``pool_page_row``). `s`: CacheStrides, or the IndexerConfig behind it (the same
    page_rows) for the host-side slot mappings."""
    return page * s.page_rows + row


def pool_key_words(s: CacheStrides, loc):
    """Layer-local word offset of the first of the 32 key words of pool slot loc."""
    page, row = pool_page_row(s, loc)
    return page * (s.page_bytes // WORD_BYTES) + row * KEY_WORDS


def pool_scale_words(s: CacheStrides, loc):
    """Layer-local word offset of the fp32 scale of pool slot loc."""
    page, row = pool_page_row(s, loc)
    return page * (s.page_bytes // WORD_BYTES) + s.page_rows * KEY_WORDS + row


# ---- tail slots (bf16 ring aliasing the start of the indexer block) -------------
def tail_slot_valid(s: CacheStrides, tslot):
    """A tail slot writes only if its tail block is 1 .. num_blocks - 1:
    ring <= tslot < num_blocks * ring (block 0, the null block, is never written)."""
    return (tslot >= s.ring) & (tslot < s.num_tail_slots)


def decode_stashes(s: CacheStrides, pos, tslot):
    """Whether a decode token stashes its key and gate into its ring row: it is live
    (pos >= 0) and its tail slot is valid (gated on the token-granular tail slot, not on
    the pool slot: bug B3)."""
    return (pos >= 0) & tail_slot_valid(s, tslot)


def decode_completes(s: CacheStrides, pos, loc, tslot):
    """Whether a decode token completes (writes) pool slot `loc`: it is live, the last
    token of its pool (pos % kpool == kpool - 1), its pool slot is valid, and so is its
    tail slot, since the pool's earlier members come from that tail block's ring. A
    token without a valid tail slot has no ring to pool from and writes nothing."""
    return decode_stashes(s, pos, tslot) & (pos % s.kpool == s.kpool - 1) & pool_slot_valid(s, loc)


def tail_slot(s, block, pos):
    """Token-granular tail slot of position `pos` in tail `block`: block * ring + pos % ring
    (``tail_block`` inverts it). `s`: CacheStrides, or the IndexerConfig behind it (the
    same ring) for the host-side slot mappings."""
    return block * s.ring + pos % s.ring


def tail_block(s: CacheStrides, tslot):
    """Tail block id of a token-granular tail slot (per token, bug B4).

    An invalid slot (negative padding, the null block 0, or a block id >= num_blocks)
    maps to the null block 0: that keeps every address inside the buffer; such a token
    never writes (and a decode token with one completes no pool either).
    """
    return (tslot * tail_slot_valid(s, tslot)) // s.ring


def tail_row_words(s: CacheStrides, block, ring_slot, half):
    """Layer-local word offset of ring row `ring_slot` of tail `block`.

    half 0 = raw K rows, half 1 = raw gate rows. The block stride is the padded
    ``tail_block_stride_bytes`` (== index_block_bytes), never ``2 * ring * 256``.
    """
    return (block * (s.tail_block_stride_bytes // WORD_BYTES)
            + half * (s.tail_half_bytes // WORD_BYTES)
            + ring_slot * TAIL_ROW_WORDS)


# ---- global word address -> (row, col) of the 2-D view -------------------------
def _split(base_words: int, local_words):
    """(row, col) of global word base_words + local_words in the [rows, VIEW_COLS] view.

    The static base is split first so every intermediate stays below 2**31 for any
    buffer size (local_words < 2**31 - VIEW_COLS is enforced by CacheLayout).
    """
    base_hi, base_lo = base_words >> VIEW_COL_BITS, base_words & (VIEW_COLS - 1)
    w = local_words + base_lo
    return base_hi + (w >> VIEW_COL_BITS), w & (VIEW_COLS - 1)


def split_word(s: CacheStrides, local_words):
    """(row, col) in the [rows, VIEW_COLS] view of layer-local indexer word offset(s)."""
    return _split(s.index_base_bytes // WORD_BYTES, local_words)


def global_word(s: CacheStrides, local_words):
    """Global word address (Python int / numpy int64 only: host-side inspection)."""
    return s.index_base_bytes // WORD_BYTES + local_words


def view_row_col(global_words):
    """(row, col) in the [rows, VIEW_COLS] view of global word addresses (numpy int64,
    host side: e.g. to gather watched bytes on the device without a flat index)."""
    return _split(0, global_words)


# ---- pages and page tables (read path) ------------------------------------------
# A page table row lists, per request, the page ids of its pools in page units:
# request-relative pool m lives in page table[col] at row r, (col, r) = pool_page_row(s, m).
def num_pages(s: CacheStrides) -> int:
    """Valid page ids of one layer: 0 .. num_pages - 1."""
    return s.num_blocks * s.pages_per_block


def block_page(s, block, j):
    """Page id of page j (0 .. pages_per_block - 1) of indexer block `block`:
    block * pages_per_block + j. `s`: CacheStrides, or the IndexerConfig behind it."""
    return block * s.pages_per_block + j


def pools_in_pages(s: CacheStrides, n_pages):
    """Pools held by n_pages pages (or page-table columns): n_pages * P."""
    return n_pages * s.page_rows


def pages_for_pools(s: CacheStrides, n_pools):
    """Pages (page-table columns) that hold the first n_pools >= 0 pools: ceil(n_pools / P)."""
    return (n_pools + (s.page_rows - 1)) // s.page_rows


def page_valid(s: CacheStrides, page):
    """A page id may be read only if 0 <= page < num_blocks * pages_per_block."""
    return (page >= 0) & (page < num_pages(s))


def page_key_words(s: CacheStrides, page, row):
    """Layer-local word offset of the first of the 32 key words of row `row` of page `page`."""
    return page * (s.page_bytes // WORD_BYTES) + row * KEY_WORDS


def key_rows_16b_aligned(s: CacheStrides) -> bool:
    """Every key row of the layer starts on a 16-byte boundary: page_bytes = 132 P
    is a multiple of 16 for P in {16, 32, 64}, so it suffices that the layer's
    base is."""
    return s.index_base_bytes % 16 == 0 and s.page_bytes % 16 == 0


def page_key_bytes(s: CacheStrides, page, row):
    """(rows, cols) [N, 8, 16] i32: where the 128 key bytes of pools (page, row) ([N]
    i32 each) lie in the byte view (``byte_view_shape``): byte 16 g + t of pool i
    at [i, g, t]. Needs ``key_rows_16b_aligned``: each group of 16 bytes then lies
    inside one view row (4 VIEW_COLS is a multiple of 16), and its column is
    written as 16 * (word col // 4) + t, the same value spelled so that Triton can
    prove the group 16-byte aligned and load it with one 128-bit access."""
    import jax.numpy as jnp                     # kernels only: the layout CLI must not import jax
    from jax import lax
    start = page_key_words(s, page, row)                                           # [N]
    n, g = start.shape[0], KEY_WORDS // 4
    r, c = split_word(s, start[:, None] + 4 * lax.broadcasted_iota(jnp.int32, (n, g), 1))   # [N, 8]
    t = lax.broadcasted_iota(jnp.int32, (n, g, 16), 2)
    return jnp.broadcast_to(r[:, :, None], (n, g, 16)), (c >> 2)[:, :, None] * 16 + t


def page_scale_words(s: CacheStrides, page, row):
    """Layer-local word offset of the fp32 scale of row `row` of page `page`."""
    return page * (s.page_bytes // WORD_BYTES) + s.page_rows * KEY_WORDS + row


def page_entries(s: CacheStrides, pages):
    """[..., 4] i32 for page ids [...] (i32): (key row, key col, scale row, scale col) of
    the page's first key word and first scale word in the word view (``split_word``),
    key row -1 for an id that is not a page of the layer. Row r of a page holds its
    key at the first key word + r * KEY_WORDS and its scale at the first scale word + r:
    the only within-page offsets the Triton read kernels add themselves."""
    import jax.numpy as jnp
    ok = page_valid(s, pages)
    p = jnp.where(ok, pages, 0)
    kr, kc = split_word(s, page_key_words(s, p, 0))
    sr, sc = split_word(s, page_scale_words(s, p, 0))
    return jnp.stack([jnp.where(ok, kr, -1), kc, sr, sc], axis=-1).astype(jnp.int32)


def table_pool(s: CacheStrides, col, row):
    """Request-relative pool index held by row `row` of page-table column `col`
    (the inverse of ``pool_page_row``)."""
    return pool_slot(s, col, row)


# ---- attention region (bf16 K/V rows of the tiny decoder, glm5_jax.model.decoder) -------
# Block b of a layer's attention region: [block_size K rows][block_size V rows][pad].
# A token-granular attention slot is block * block_size + pos % block_size; the
# request's block table (manager block ids) maps a request-relative token to it.
def attn_slot_valid(a, slot):
    """An attention slot reads/writes only if 0 <= slot < num_blocks * block_size."""
    return (slot >= 0) & (slot < a.num_attn_slots)


def attn_token_block_col(a, tok):
    """(block-table column, row in block) of request-relative token tok (tok >= 0)."""
    return tok // a.block_size, tok % a.block_size


def attn_slot(a, block, row):
    """Token-granular attention slot of row `row` of manager block `block`."""
    return block * a.block_size + row


def attn_row_width_words(a) -> int:
    """Words of one K or V row (kv_row_bytes / 4)."""
    return a.kv_row_bytes // WORD_BYTES


def attn_row_words(a, slot, half):
    """Layer-local word offset of the K (half 0) or V (half 1) row of attention slot `slot`."""
    block, row = slot // a.block_size, slot % a.block_size
    return (block * (a.attn_block_bytes // WORD_BYTES)
            + half * (a.block_size * attn_row_width_words(a))
            + row * attn_row_width_words(a))


def attn_rows_aligned(a) -> bool:
    """Whether the K/V rows are the rows of a ``u32[total_words // row_words, row_words]``
    view of the buffer (row_words = kv_row_bytes / 4): every row starts on a multiple of
    its size (the layer base and the block stride are multiples of it) and a row width
    divides the view row, so the view is a reshape. Then ``attn_row_index`` gives one index
    per row instead of one (row, col) pair per word."""
    return (VIEW_COLS % attn_row_width_words(a) == 0 and a.attn_base_bytes % a.kv_row_bytes == 0
            and a.attn_block_bytes % a.kv_row_bytes == 0)


def attn_row_index(a, slot, half):
    """Row of the K (half 0) or V (half 1) row of attention slot `slot` in the
    ``u32[total_words // row_words, row_words]`` view (``attn_rows_aligned`` layouts only).
    Base rows + local rows: no intermediate passes 2**31 for any buffer size."""
    return a.attn_base_bytes // a.kv_row_bytes + attn_row_words(a, slot, half) // attn_row_width_words(a)


def attn_split_word(a, local_words):
    """(row, col) in the [rows, VIEW_COLS] view of an attention-region word offset
    (layer-local, as returned by ``attn_row_words``); same scheme as ``split_word``."""
    return _split(a.attn_base_bytes // WORD_BYTES, local_words)


def attn_global_word(a, local_words):
    """Global word address of an attention-region offset (host-side inspection only)."""
    return a.attn_base_bytes // WORD_BYTES + local_words


# ---- whole blocks and layers (host-side inspection, ownership checks, the layout) ----
def layer_base_bytes(region_start_bytes: int, layer_region_bytes: int, layer: int) -> int:
    """Start of `layer`'s part of a region whose layers lie back to back from
    region_start_bytes, layer_region_bytes each (the flat buffer: every layer's
    attention region from byte 0, then every layer's indexer region)."""
    return region_start_bytes + layer * layer_region_bytes


def byte_span_words(start_bytes, end_bytes):
    """(start, end) word addresses of the word-aligned byte span [start_bytes, end_bytes)."""
    return start_bytes // WORD_BYTES, end_bytes // WORD_BYTES


def index_block_byte_range(s: CacheStrides, block: int) -> tuple[int, int]:
    """[start, end) global bytes of indexer block `block` (its tail ring aliases the start)."""
    start = s.index_base_bytes + block * s.index_block_bytes
    return start, start + s.index_block_bytes


def index_block_of_byte(s: CacheStrides, global_bytes: int):
    """(indexer block, byte offset in it) holding global byte `global_bytes`, or None
    when the byte is outside this layer's indexer region (host-side inspection)."""
    local = global_bytes - s.index_base_bytes
    if not 0 <= local < s.num_blocks * s.index_block_bytes:
        return None
    return divmod(local, s.index_block_bytes)


def attn_block_byte_range(attn_base_bytes: int, attn_block_bytes: int, block: int) -> tuple[int, int]:
    """[start, end) global bytes of attention block `block` of a layer's attention region."""
    start = attn_base_bytes + block * attn_block_bytes
    return start, start + attn_block_bytes
