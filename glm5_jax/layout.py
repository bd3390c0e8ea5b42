"""CacheLayout: the ONE flat buffer holding every layer's attention, indexer and
tail bytes, and the per-layer CacheStrides handed to kernels.

Byte layout (little-endian; docs/semantics.md 3.3, docs/design.md):

    [attention region: layer 0..L-1, each num_blocks * attn_block_bytes]   (absent when 0)
    [indexer region:   layer 0..L-1, each num_blocks * index_block_bytes]
    [zero padding up to a multiple of 4 KiB]

The tail ring of block b aliases the start of indexer block b of the same layer.
The buffer is a 1-D uint32 array (4 bytes per word, so element offsets stay small);
``jax.lax.bitcast_convert_type`` gives the byte view for free.

Size limits (checked when a CacheLayout is made, before anything is built per layer):
one layer's indexer region and one layer's attention region each stay below 8 GiB
(2**31 - 1024 words: kernels add int32 layer-local word offsets to a static base), and
the whole buffer below 8 TiB (its [rows, 1024] word view must have int32 row indices).
``allocate`` also refuses a buffer larger than the memory of the device it goes to.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.core import addressing as addr
from pallas_kernels.core.strides import AttnStrides, CacheStrides, VIEW_COLS, WORD_BYTES

from .config import MAX_REGION_WORDS, IndexerConfig, checked_int

FAULTS = ("dense-tail-stride",)
MAX_VIEW_ROWS = 2**31 - 1                     # rows of the [rows, VIEW_COLS] word view: int32 indices
MAX_TOTAL_BYTES = MAX_VIEW_ROWS * VIEW_COLS * WORD_BYTES   # just under 8 TiB


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    config: IndexerConfig
    num_layers: int
    num_blocks: int
    attn_block_bytes: int = 0

    def __post_init__(self):
        if not isinstance(self.config, IndexerConfig):
            raise ValueError(f"config must be an IndexerConfig, got {type(self.config).__name__}")
        for name in ("num_layers", "num_blocks", "attn_block_bytes"):      # numpy integers become ints
            object.__setattr__(self, name, checked_int("CacheLayout", name, getattr(self, name)))
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.attn_block_bytes < 0 or self.attn_block_bytes % WORD_BYTES:
            raise ValueError(f"attn_block_bytes must be a non-negative multiple of 4, got {self.attn_block_bytes}")
        if self.index_region_bytes // WORD_BYTES >= MAX_REGION_WORDS:
            raise ValueError(
                f"one layer's indexer region ({self.index_region_bytes} B) must stay below 8 GiB; "
                f"use fewer blocks per device")
        if self.attn_region_bytes // WORD_BYTES >= MAX_REGION_WORDS:
            raise ValueError(
                f"one layer's attention region ({self.attn_region_bytes} B) must stay below 8 GiB; "
                f"use fewer blocks per device or smaller attention blocks")
        if self.total_bytes > MAX_TOTAL_BYTES:
            per_block = self.bytes_per_block // self.num_layers
            raise ValueError(
                f"the buffer of {self.num_layers} layers x {self.num_blocks} blocks x {per_block} B would be "
                f"{self.total_bytes:,} B ({_gib(self.total_bytes)}): more than the {_gib(MAX_TOTAL_BYTES)} "
                f"its word view can address; use fewer layers or blocks")
        # Every layer's strides pass CacheStrides' checks if the first and the last do (the
        # layers differ only in their base), so an impossible layout fails here, at once.
        for layer in sorted({0, self.num_layers - 1}):
            self.strides(layer)
            if self.attn_block_bytes:
                addr.attn_block_byte_range(self.attn_base_bytes(layer), self.attn_block_bytes, 0)

    # ---- sizes (bytes) -----------------------------------------------------------
    @property
    def attn_region_bytes(self) -> int:          # one layer
        return self.num_blocks * self.attn_block_bytes

    @property
    def index_region_bytes(self) -> int:         # one layer
        return self.num_blocks * self.config.index_block_bytes

    @property
    def used_bytes(self) -> int:
        return self.num_layers * (self.attn_region_bytes + self.index_region_bytes)

    @property
    def total_bytes(self) -> int:                # padded to whole 4 KiB rows of the kernel view
        row = VIEW_COLS * WORD_BYTES
        return -(-self.used_bytes // row) * row

    @property
    def total_words(self) -> int:
        return self.total_bytes // WORD_BYTES

    @property
    def bytes_per_block(self) -> int:            # all layers, attention + indexer
        return self.num_layers * (self.attn_block_bytes + self.config.index_block_bytes)

    def attn_base_bytes(self, layer: int) -> int:
        layer = self._check_layer(layer)
        return addr.layer_base_bytes(0, self.attn_region_bytes, layer)

    def index_base_bytes(self, layer: int) -> int:
        layer = self._check_layer(layer)
        attn_end = addr.layer_base_bytes(0, self.attn_region_bytes, self.num_layers)   # the indexer region's start
        return addr.layer_base_bytes(attn_end, self.index_region_bytes, layer)

    def _check_layer(self, layer) -> int:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def _check_block(self, block) -> int:
        if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)) \
                or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")
        return int(block)

    def _check_cache(self, cache):
        """The host words of a flat cache of this layout (uint32[total_words]), or a ValueError."""
        words = np.asarray(cache)
        if words.dtype != np.uint32 or words.shape != (self.total_words,):
            raise ValueError(f"cache must be uint32[{self.total_words}] (this layout's flat buffer), got "
                             f"{words.dtype}{list(words.shape)}")
        return words

    # ---- strides -----------------------------------------------------------------
    def strides(self, layer: int) -> CacheStrides:
        """The explicit stride metadata of one layer: the only thing kernels get
        (``with_fault`` gives a layout whose strides carry a historical bug)."""
        c = self.config
        return CacheStrides(
            kpool=c.kpool, ring=c.ring, page_rows=c.page_rows, pages_per_block=c.pages_per_block,
            num_blocks=self.num_blocks, index_base_bytes=self.index_base_bytes(layer),
            index_block_bytes=c.index_block_bytes, total_bytes=self.total_bytes)

    def attn_strides(self, layer: int, kv_row_bytes: int) -> AttnStrides:
        """Stride metadata of one layer's attention region, for K/V rows of kv_row_bytes.

        Each attention block holds block_size K rows then block_size V rows; a
        ValueError says so if attn_block_bytes is too small for that.
        """
        if self.attn_block_bytes == 0:
            raise ValueError("this layout has no attention region (attn_block_bytes = 0)")
        kv_row_bytes = checked_int("attn_strides", "kv_row_bytes", kv_row_bytes)
        return AttnStrides(block_size=self.config.block_size, kv_row_bytes=kv_row_bytes,
                           num_blocks=self.num_blocks, attn_base_bytes=self.attn_base_bytes(layer),
                           attn_block_bytes=self.attn_block_bytes, total_bytes=self.total_bytes)

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, fill_byte: int = 0, device=None):
        """The flat cache: uint32[total_words], every byte = fill_byte (a sentinel for tests).
        fill_byte: an int (or numpy integer) in [0, 255]."""
        import jax
        import jax.numpy as jnp
        fill_byte = checked_int("allocate", "fill_byte", fill_byte)
        if not 0 <= fill_byte <= 255:
            raise ValueError(f"fill_byte must be in [0, 255], got {fill_byte}")
        limit, where = _device_memory_bytes(device)
        if limit is not None and self.total_bytes > limit:
            raise ValueError(f"allocate: the buffer is {self.total_bytes:,} B ({_gib(self.total_bytes)}), more than "
                             f"the {limit:,} B ({_gib(limit)}) of {where}; use fewer layers or blocks")
        word = np.uint32(fill_byte * 0x01010101)
        buf = jnp.full((self.total_words,), word, dtype=jnp.uint32)
        return jax.device_put(buf, device) if device is not None else buf

    # ---- read-only inspection views (host side, built only from the strides) -------
    def pool_keys(self, cache, layer: int):
        """(keys fp8 [num_blocks * S, 128], scales f32 [num_blocks * S]) of one layer, by pool slot."""
        import ml_dtypes
        s = self.strides(layer)
        words = self._check_cache(cache)
        loc = np.arange(s.num_pool_slots, dtype=np.int64)
        kw = addr.global_word(s, addr.pool_key_words(s, loc))[:, None] + np.arange(addr.KEY_WORDS)
        keys = words[kw].view(np.uint8).reshape(-1, 128).view(ml_dtypes.float8_e4m3fn)
        scales = words[addr.global_word(s, addr.pool_scale_words(s, loc))].view(np.float32)
        return keys, scales

    def tail_ring(self, cache, layer: int):
        """(K, gate) bf16 [num_blocks, ring, 128] of one layer's tail rings, by block and ring slot."""
        import ml_dtypes
        s = self.strides(layer)
        words = self._check_cache(cache)
        blk = np.arange(s.num_blocks, dtype=np.int64)[:, None]
        slot = np.arange(s.ring, dtype=np.int64)[None, :]
        out = []
        for half in (0, 1):
            w = addr.global_word(s, addr.tail_row_words(s, blk, slot, half))[..., None] + np.arange(addr.TAIL_ROW_WORDS)
            out.append(words[w].view(np.uint16).reshape(s.num_blocks, s.ring, 128).view(ml_dtypes.bfloat16))
        return tuple(out)

    def attn_kv(self, cache, layer: int, kv_row_bytes: int):
        """(K, V) raw rows uint8 [num_blocks, block_size, kv_row_bytes] of one layer's attention region."""
        a = self.attn_strides(layer, kv_row_bytes)
        words = self._check_cache(cache)
        slot = np.arange(a.num_attn_slots, dtype=np.int64)
        out = []
        for half in (0, 1):
            w = (addr.attn_global_word(a, addr.attn_row_words(a, slot, half))[:, None]
                 + np.arange(addr.attn_row_width_words(a)))
            out.append(words[w].view(np.uint8).reshape(a.num_blocks, a.block_size, kv_row_bytes))
        return tuple(out)

    def block_byte_range(self, layer: int, block: int) -> tuple[int, int]:
        """[start, end) bytes of indexer block `block` (0 .. num_blocks - 1) of `layer` (its
        tail aliases the start)."""
        return addr.index_block_byte_range(self.strides(layer), self._check_block(block))

    def attn_block_byte_range(self, layer: int, block: int) -> tuple[int, int]:
        """[start, end) bytes of attention block `block` (0 .. num_blocks - 1) of `layer`
        (empty when there is no region)."""
        return addr.attn_block_byte_range(self.attn_base_bytes(layer), self.attn_block_bytes,
                                          self._check_block(block))

    # ---- memory plan ---------------------------------------------------------------
    def summary(self) -> dict:
        c = self.config
        usable_blocks = self.num_blocks - 1          # block 0 is the null block
        return {
            "block_size_tokens": c.block_size,
            "kpool": c.kpool,
            "num_spec_tokens": c.num_spec_tokens,
            "ring_tokens": c.ring,
            "pools_per_block": c.pools_per_block,
            "page_rows": c.page_rows,
            "pages_per_block": c.pages_per_block,
            "page_bytes": c.page_bytes,
            "index_block_bytes": c.index_block_bytes,
            "tail_block_bytes": c.tail_block_bytes,
            "tail_block_stride_elems": c.tail_block_stride_elems,
            "attn_block_bytes": self.attn_block_bytes,
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "bytes_per_block_all_layers": self.bytes_per_block,
            "index_bytes_per_token_per_layer": c.index_bytes_per_token,
            "tokens_that_fit": usable_blocks * c.block_size,
            "total_bytes": self.total_bytes,
        }

    def table(self) -> str:
        rows = [(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else f"{v:g}")
                for k, v in self.summary().items()]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v:>16}" for k, v in rows)


@dataclasses.dataclass(frozen=True)
class FaultyLayout(CacheLayout):
    """A CacheLayout whose strides carry an injected historical bug: the diagnostic
    hook of the corruption probe and its tests. Built only by ``with_fault``; it goes
    wherever a layout goes (ops, the model, the Engine), so every reader and writer
    that addresses the cache through its strides honours the fault.

    "dense-tail-stride" (docs/semantics.md B1): tail blocks addressed with the dense stride
    2 * ring * 256 bytes instead of the padded index_block_bytes."""
    fault: str = FAULTS[0]

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {FAULTS}")
        super().__post_init__()

    def strides(self, layer: int) -> CacheStrides:
        return dataclasses.replace(super().strides(layer), tail_block_stride_bytes=self.config.tail_block_bytes)


def with_fault(layout: CacheLayout, fault: str | None) -> CacheLayout:
    """`layout` with `fault` (one of FAULTS) injected into its strides; fault=None
    gives the correct layout (any fault removed). ValueError for an unknown fault."""
    base = dict(config=layout.config, num_layers=layout.num_layers, num_blocks=layout.num_blocks,
                attn_block_bytes=layout.attn_block_bytes)
    if fault is None:
        return CacheLayout(**base)
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
    return FaultyLayout(**base, fault=fault)


def _device_memory_bytes(device=None):
    """(bytes the buffer's device can hold, what it is) or (None, None) when unknown:
    the device's bytes_limit where it reports one (GPUs), the host's physical memory for
    the CPU backend. `device`: what allocate's device_put gets (None: the default device;
    a sharding or anything without memory stats: unknown)."""
    import jax
    if device is None:
        device = jax.devices()[0]
    if not hasattr(device, "platform"):
        return None, None
    try:
        stats = device.memory_stats()
    except Exception:                       # backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"device {device}"
    if device.platform == "cpu":
        try:
            import os
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory"
        except (ValueError, OSError, AttributeError):
            return None, None
    return None, None
