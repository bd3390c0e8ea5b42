"""IndexerConfig and CacheLayout: derived geometry, validation rules, the flat
buffer's byte layout (docs/semantics.md 3.1-3.4, docs/design.md "One flat buffer of uint32 words") and the
host-side inspection views."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm5_jax.config import IndexerConfig, next_pow2
from glm5_jax.layout import CacheLayout, with_fault
from glm5_jax.testing import random_ape, random_rows
from pallas_kernels.core import addressing as addr
from pallas_kernels.core import numerics as nm
from pallas_kernels.core.strides import CacheStrides

import refjit

SENTINEL = 0xA5


# ---------------------------------------------------------------------------------
# IndexerConfig
# ---------------------------------------------------------------------------------
def test_config_defaults_are_glm53_flash():
    c = IndexerConfig()
    assert (c.head_dim, c.n_heads, c.kpool, c.topk, c.block_size, c.num_spec_tokens) == \
        (128, 32, 4, 2048, 1152, 0)
    assert c.pools_per_block == 288
    assert c.page_rows == 32
    assert c.pages_per_block == 9
    assert c.page_bytes == 4224
    assert c.index_block_bytes == 38016
    assert c.ring == 4
    assert c.tail_block_bytes == 2048
    assert c.tail_block_stride_elems == 19008
    assert c.topk_pools == 512
    assert c.index_width == 2051
    assert c.index_bytes_per_token == 33.0


def test_config_is_frozen_and_hashable():
    c = IndexerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kpool = 16
    assert hash(c) == hash(IndexerConfig()) and c == IndexerConfig()
    assert c != IndexerConfig(num_spec_tokens=1)


# docs/semantics.md 3.2 worked numbers, R = 4: B -> (S, idx_page bytes, Spg, pages/block, page bytes, tail stride elems)
WORKED = {
    640: (160, 21120, 32, 5, 4224, 10560),
    1024: (256, 33792, 64, 4, 8448, 16896),
    1152: (288, 38016, 32, 9, 4224, 19008),
    1280: (320, 42240, 64, 5, 8448, 21120),
    2176: (544, 71808, 32, 17, 4224, 35904),
    2304: (576, 76032, 64, 9, 8448, 38016),
    3584: (896, 118272, 64, 14, 8448, 59136),
    4352: (1088, 143616, 64, 17, 8448, 71808),
}


@pytest.mark.parametrize("block_size", sorted(WORKED))
def test_spec_worked_numbers_table(block_size):
    c = IndexerConfig(block_size=block_size)
    got = (c.pools_per_block, c.index_block_bytes, c.page_rows, c.pages_per_block, c.page_bytes,
           c.tail_block_stride_elems)
    assert got == WORKED[block_size]
    assert c.page_rows * c.pages_per_block == c.pools_per_block
    assert c.page_bytes * c.pages_per_block == c.index_block_bytes


def test_page_rows_rule():
    """S <= 64 -> one page of S rows; else 64 if S % 64 == 0; else 32."""
    for kpool in (4, 16):
        for s in range(1, 65):
            bs = kpool * s
            try:
                c = IndexerConfig(kpool=kpool, block_size=bs)
            except ValueError:
                continue                     # e.g. tail ring larger than a tiny block
            assert (c.page_rows, c.pages_per_block) == (s, 1), bs
        for s in range(65, 1200):
            bs = kpool * s
            if s % 32:
                continue
            c = IndexerConfig(kpool=kpool, block_size=bs)
            assert c.page_rows == (64 if s % 64 == 0 else 32), bs
            assert c.pages_per_block == s // c.page_rows


@pytest.mark.parametrize("n_spec, ring", [(0, 4), (1, 8), (2, 8), (3, 8), (4, 8),
                                          (5, 16), (6, 16), (7, 16), (8, 16)])
def test_ring_size_kpool4(n_spec, ring):
    assert IndexerConfig(num_spec_tokens=n_spec).ring == ring


@pytest.mark.parametrize("kpool", [1, 2, 4, 8, 16])
def test_ring_formula(kpool):
    for n_spec in range(0, 20):
        want = kpool * next_pow2(math.ceil((kpool + n_spec) / kpool))
        bs = max(kpool * 64, want) * 4             # large enough for any ring here
        bs = -(-bs // want) * want
        try:
            c = IndexerConfig(kpool=kpool, num_spec_tokens=n_spec, block_size=bs)
        except ValueError as e:                     # only the page-height rule may bite
            assert "kpool*32" in str(e)
            continue
        assert c.ring == want
        assert c.ring >= kpool + n_spec and c.ring % kpool == 0
        assert c.tail_block_bytes == 2 * c.ring * 256


def test_next_pow2():
    assert [next_pow2(n) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert next_pow2(2**20) == 2**20 and next_pow2(2**20 + 1) == 2**21


BAD_CONFIGS = [
    (dict(head_dim=64), r"head_dim must be 128"),
    (dict(head_dim=256), r"head_dim must be 128"),
    (dict(n_heads=0), r"n_heads must be in \[1, 64\]"),
    (dict(n_heads=65), r"n_heads must be in \[1, 64\] \(the logits take 32 or 64 zero-padded heads\), got 65"),
    (dict(n_heads=-3), r"n_heads must be in \[1, 64\]"),
    (dict(kpool=0), r"kpool must be >= 1"),
    (dict(num_spec_tokens=-1), r"num_spec_tokens must be >= 0"),
    (dict(topk=2046), r"topk \(2046\) must be a positive multiple of kpool"),
    (dict(topk=2), r"topk \(2\) must be a positive multiple of kpool"),
    (dict(block_size=1150), r"block_size \(1150\) must be a multiple of kpool \(4\)"),
    (dict(block_size=0), r"block_size \(0\) must be a multiple of kpool"),
    # S = 80 > 64 pools per block, not a multiple of 32
    (dict(block_size=320), r"multiple of kpool\*32 = 128 when a block holds more than 64 pools \(80\)"),
    (dict(kpool=16, block_size=16 * 100), r"multiple of kpool\*32 = 512"),
    # S = 8: 1056-byte indexer block, 2048-byte tail ring
    (dict(block_size=32), r"tail ring larger than an indexer block: 2\*ring\*256 = 2048 B > "
                          r"index_block_bytes = 1056 B"),
    (dict(block_size=128, num_spec_tokens=5), r"tail ring larger than an indexer block"),
    # ring 8 (n_spec 1) fits in S = 33 rows (4356 B) but does not divide 132 tokens
    (dict(block_size=132, num_spec_tokens=1), r"ring \(8\) must divide block_size \(132\)"),
    (dict(block_size=2**27), r"block_size \(134217728\) too large: an indexer block of 4429185024 B leaves no "
                             r"room for the 2 blocks"),
    (dict(block_size=1152.0), r"IndexerConfig.block_size must be an int, got 1152.0 \(float\)"),
    (dict(kpool=True), r"IndexerConfig.kpool must be an int, got True \(bool\)"),
    (dict(kpool=np.bool_(True)), r"IndexerConfig.kpool must be an int, got np.True_ \(bool\)"),
    (dict(num_spec_tokens="1"), r"IndexerConfig.num_spec_tokens must be an int, got '1' \(str\)"),
    (dict(n_heads=np.float32(32)), r"IndexerConfig.n_heads must be an int, got .*32.* \(float32\)"),
    (dict(topk=None), r"IndexerConfig.topk must be an int, got None \(NoneType\)"),
    (dict(head_dim=128.0), r"IndexerConfig.head_dim must be an int"),
]


@pytest.mark.parametrize("kwargs, msg", BAD_CONFIGS, ids=[str(k) for k, _ in BAD_CONFIGS])
def test_config_rejects(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        IndexerConfig(**kwargs)


def test_config_takes_numpy_integers_as_ints():
    """A numpy integer is an int (the value a caller read from an array); the fields
    hold Python ints, so the config equals and hashes like one built from ints."""
    c = IndexerConfig(n_heads=np.int32(16), kpool=np.int64(4), block_size=np.uint16(1152), topk=np.int16(2048),
                      num_spec_tokens=np.int8(1), head_dim=np.int64(128))
    assert c == IndexerConfig(n_heads=16, num_spec_tokens=1) and hash(c) == hash(IndexerConfig(n_heads=16,
                                                                                             num_spec_tokens=1))
    assert all(type(getattr(c, f.name)) is int for f in dataclasses.fields(c))
    assert IndexerConfig(n_heads=64).n_heads == 64 and IndexerConfig(n_heads=1).n_heads == 1


def test_config_accepts_edge_cases():
    # exactly 64 pools (one page), tail exactly filling ... and a ring of 16 in a 64-row block
    assert IndexerConfig(block_size=256).page_rows == 64
    c = IndexerConfig(kpool=4, block_size=64)                 # S = 16, 2112 B >= 2048 B tail
    assert c.index_block_bytes == 2112 and c.tail_block_bytes == 2048
    c = IndexerConfig(kpool=16, block_size=1024)              # S = 64, 8448 B >= 8192 B tail
    assert c.ring == 16 and c.pages_per_block == 1


# ---------------------------------------------------------------------------------
# CacheStrides validation (the kernels' contract)
# ---------------------------------------------------------------------------------
def _strides(**kw):
    base = dict(kpool=4, ring=4, page_rows=32, pages_per_block=9, num_blocks=8, index_base_bytes=0,
                index_block_bytes=38016, total_bytes=8 * 38016 + 4096 - (8 * 38016) % 4096)
    base.update(kw)
    return CacheStrides(**base)


def test_cache_strides_rules():
    s = _strides()
    assert s.tail_block_stride_bytes == 38016 and s.is_padded_tail_stride
    assert s.num_pool_slots == 8 * 288 and s.num_tail_slots == 8 * 4
    with pytest.raises(ValueError, match="ring .* must be a positive multiple of kpool"):
        _strides(ring=6)
    with pytest.raises(ValueError, match="index_block_bytes must equal"):
        _strides(index_block_bytes=38020)
    with pytest.raises(ValueError, match="tail ring .* larger than an indexer block"):
        _strides(ring=128)
    with pytest.raises(ValueError, match="tail_block_stride_bytes must be word aligned"):
        _strides(tail_block_stride_bytes=1024)
    with pytest.raises(ValueError, match="word aligned"):
        _strides(index_base_bytes=2)
    with pytest.raises(ValueError, match="runs past the end"):
        _strides(index_base_bytes=4096)
    with pytest.raises(ValueError, match="non-negative int"):
        _strides(num_blocks=-1)
    with pytest.raises(ValueError, match="non-negative int"):
        _strides(kpool=4.0)


# ---------------------------------------------------------------------------------
# CacheLayout
# ---------------------------------------------------------------------------------
def test_layout_frozen_hashable_and_jit_static():
    cfg = IndexerConfig(block_size=128)
    a = CacheLayout(cfg, num_layers=2, num_blocks=5, attn_block_bytes=64)
    b = CacheLayout(IndexerConfig(block_size=128), num_layers=2, num_blocks=5, attn_block_bytes=64)
    assert a == b and hash(a) == hash(b)
    assert a != CacheLayout(cfg, num_layers=2, num_blocks=6, attn_block_bytes=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_blocks = 7
    assert hash(a.strides(1)) == hash(b.strides(1)) and a.strides(1) == b.strides(1)

    traces = []

    def f(cache, layout):
        traces.append(layout)
        return cache + jnp.uint32(layout.strides(1).index_base_bytes)

    jf = jax.jit(f, static_argnums=1)
    out = jf(jnp.zeros(3, jnp.uint32), a)
    out2 = jf(jnp.zeros(3, jnp.uint32), b)          # equal layout: no retrace
    assert len(traces) == 1
    assert int(out[0]) == int(out2[0]) == a.index_base_bytes(1)
    jf(jnp.zeros(3, jnp.uint32), CacheLayout(cfg, num_layers=2, num_blocks=6, attn_block_bytes=64))
    assert len(traces) == 2


@pytest.mark.parametrize("num_layers, num_blocks, attn", [(1, 2, 0), (2, 7, 0), (3, 5, 1056), (2, 3, 4)])
@pytest.mark.parametrize("block_size", [64, 1152, 1024])
def test_layout_regions_and_padding(rng, num_layers, num_blocks, attn, block_size):
    cfg = IndexerConfig(block_size=block_size)
    lay = CacheLayout(cfg, num_layers=num_layers, num_blocks=num_blocks, attn_block_bytes=attn)
    ib = cfg.index_block_bytes
    used = num_layers * num_blocks * (attn + ib)
    assert lay.used_bytes == used
    assert lay.total_bytes % 4096 == 0 and used <= lay.total_bytes < used + 4096
    assert lay.total_words * 4 == lay.total_bytes
    assert lay.bytes_per_block == num_layers * (attn + ib)
    assert lay.attn_region_bytes == num_blocks * attn and lay.index_region_bytes == num_blocks * ib
    for l in range(num_layers):
        assert lay.attn_base_bytes(l) == l * num_blocks * attn
        assert lay.index_base_bytes(l) == num_layers * num_blocks * attn + l * num_blocks * ib
        s = lay.strides(l)
        assert s.index_base_bytes == lay.index_base_bytes(l)
        assert (s.kpool, s.ring, s.page_rows, s.pages_per_block, s.num_blocks) == \
            (cfg.kpool, cfg.ring, cfg.page_rows, cfg.pages_per_block, num_blocks)
        assert s.index_block_bytes == ib == s.tail_block_stride_bytes
        assert s.total_bytes == lay.total_bytes
        for b in range(num_blocks):
            assert lay.block_byte_range(l, b) == (lay.index_base_bytes(l) + b * ib,
                                                  lay.index_base_bytes(l) + (b + 1) * ib)
            # the inverse (diagnosis scripts): every byte of the block maps back to it
            a, e = lay.block_byte_range(l, b)
            for byte in (a, a + int(rng.integers(ib)), e - 1):
                assert addr.index_block_of_byte(s, byte) == (b, byte - a)
        assert addr.index_block_of_byte(s, lay.index_base_bytes(l) - 1) is None
        assert addr.index_block_of_byte(s, lay.index_base_bytes(l) + num_blocks * ib) is None
    # the last layer's indexer region ends exactly at used_bytes
    assert lay.index_base_bytes(num_layers - 1) + num_blocks * ib == used


def test_layout_strides_1152_and_dense_fault():
    lay = CacheLayout(IndexerConfig(), num_layers=2, num_blocks=800, attn_block_bytes=0)
    s = lay.strides(1)
    assert s.index_block_bytes == 38016
    assert s.tail_block_stride_bytes == 38016 == 2 * 19008         # 19008 bf16 elements
    assert s.tail_half_bytes == 4 * 256 and s.tail_block_bytes == 2048
    assert s.page_bytes == 4224 and s.pools_per_block == 288
    assert s.index_base_bytes == 800 * 38016
    assert s.is_padded_tail_stride
    f = with_fault(lay, "dense-tail-stride").strides(1)
    assert f.tail_block_stride_bytes == 2 * 4 * 256 == 2048
    assert not f.is_padded_tail_stride
    assert dataclasses.replace(f, tail_block_stride_bytes=38016) == s
    # ring 8 (n_spec 3): dense stride 4096
    lay8 = CacheLayout(IndexerConfig(num_spec_tokens=3), num_layers=1, num_blocks=4)
    assert with_fault(lay8, "dense-tail-stride").strides(0).tail_block_stride_bytes == 4096
    assert with_fault(with_fault(lay, "dense-tail-stride"), None) == lay
    assert lay8.strides(0).tail_block_stride_bytes == 38016


BAD_LAYOUTS = [
    (lambda: CacheLayout("cfg", 1, 4), "config must be an IndexerConfig"),
    (lambda: CacheLayout(IndexerConfig(), 0, 4), "num_layers must be >= 1"),
    (lambda: CacheLayout(IndexerConfig(), 1.0, 4), r"CacheLayout.num_layers must be an int, got 1.0 \(float\)"),
    (lambda: CacheLayout(IndexerConfig(), True, 4), r"CacheLayout.num_layers must be an int, got True \(bool\)"),
    (lambda: CacheLayout(IndexerConfig(), 1, 1), r"num_blocks must be >= 2 \(block 0 is the null block\)"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4.0), r"CacheLayout.num_blocks must be an int, got 4.0 \(float\)"),
    (lambda: CacheLayout(IndexerConfig(), 1, np.int32(1)), r"num_blocks must be >= 2 \(block 0 is the null block\), "
                                                          r"got 1$"),
    (lambda: CacheLayout(IndexerConfig(), 1, np.float64(8)), r"CacheLayout.num_blocks must be an int, got "
                                                            r"np.float64\(8.0\) \(float64\)"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4, attn_block_bytes=6), "attn_block_bytes must be a non-negative multiple of 4"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4, attn_block_bytes=-4), "attn_block_bytes must be"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4, attn_block_bytes=8.0), "attn_block_bytes must be"),
    (lambda: CacheLayout(IndexerConfig(), 1, 2**31 // 38016 * 4 + 1000), "must stay below 8 GiB"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4, attn_block_bytes=2**32), r"one layer's attention region "
                                                                        r"\(17179869184 B\) must stay below 8 GiB"),
    (lambda: CacheLayout(IndexerConfig(), 10**8, 800), r"the buffer of 100000000 layers x 800 blocks x 38016 B would "
                                                       r"be .* B \(.* GiB\): more than the 8,192.0 GiB its word view "
                                                       r"can address"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).strides(2), r"layer must be an int in \[0, 2\)"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).strides(-1), r"layer must be an int in \[0, 2\)"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).index_base_bytes(1.0), "layer must be an int"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).attn_base_bytes(5), "layer must be an int"),
    (lambda: with_fault(CacheLayout(IndexerConfig(), 2, 4), "dense"), "unknown fault 'dense'"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4).allocate(256), r"fill_byte must be in \[0, 255\], got 256"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4).allocate(-1), r"fill_byte must be in \[0, 255\]"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4).allocate(1.5), r"allocate.fill_byte must be an int, got 1.5 \(float\)"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4).allocate(True),
     r"allocate.fill_byte must be an int, got True \(bool\)"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).strides(True), r"layer must be an int in \[0, 2\), got True"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).block_byte_range(0, 4), r"block must be an int in \[0, 4\), got 4"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).block_byte_range(1, -1), r"block must be an int in \[0, 4\), got -1"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4).block_byte_range(1, 2.0), r"block must be an int in \[0, 4\), got 2.0"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4, 1024).attn_block_byte_range(1, 9), r"block must be an int in \[0, 4\)"),
    (lambda: CacheLayout(IndexerConfig(), 2, 4, 1024).attn_strides(0, 512.5), r"attn_strides.kv_row_bytes must be an "
                                                                            r"int, got 512.5 \(float\)"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4).pool_keys(np.zeros(8, np.uint32), 0),
     r"cache must be uint32\[\d+\] \(this layout's flat buffer\), got uint32\[8\]"),
    (lambda: CacheLayout(IndexerConfig(), 1, 4).tail_ring(np.zeros(CacheLayout(IndexerConfig(), 1, 4).total_words,
                                                                   np.int32), 0), r"cache must be uint32"),
]


@pytest.mark.parametrize("make, msg", BAD_LAYOUTS, ids=[m for _, m in BAD_LAYOUTS])
def test_layout_rejects(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_layout_takes_numpy_integers_as_ints():
    """num_layers / num_blocks / attn_block_bytes read from numpy arrays are ints: the
    layout equals (and hashes like, a static jit argument) the one built from ints, and
    every numpy integer the helpers take (layer, block, fill byte) works too."""
    a = CacheLayout(IndexerConfig(), num_layers=np.int64(2), num_blocks=np.int32(8), attn_block_bytes=np.uint16(64))
    b = CacheLayout(IndexerConfig(), num_layers=2, num_blocks=8, attn_block_bytes=64)
    assert a == b and hash(a) == hash(b) and type(a.num_blocks) is int
    assert a.block_byte_range(np.int32(1), np.int64(7)) == b.block_byte_range(1, 7)
    assert a.strides(np.int8(1)) == b.strides(1)
    assert (np.asarray(a.allocate(np.uint8(0xA5))).view(np.uint8) == 0xA5).all()


def test_layout_size_limits_are_checked_up_front():
    """The size limits are checked before anything is built per layer, so a layout of
    10**8 layers is refused (or made) at once; a layout past 2**32 words within the
    limits is a layout (16+ GiB on a big device), and allocate refuses a buffer its device
    cannot hold with the sizes in the message instead of trying."""
    import time
    from glm5_jax import layout as L
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="its word view can address"):
        CacheLayout(IndexerConfig(), num_layers=10**8, num_blocks=800)
    tiny = CacheLayout(IndexerConfig(block_size=64), num_layers=10**8, num_blocks=2)
    assert tiny.index_base_bytes(10**8 - 1) == (10**8 - 1) * 2 * 2112 and tiny.strides(10**8 - 1).num_blocks == 2
    assert time.perf_counter() - t0 < 2.0
    assert L.MAX_TOTAL_BYTES == (2**31 - 1) * 4096
    big = CacheLayout(IndexerConfig(), num_layers=120, num_blocks=4096)
    assert big.total_words > 2**32 and big.strides(119).index_base_bytes > 2**34
    huge = CacheLayout(IndexerConfig(), num_layers=50_000, num_blocks=4096)          # 7.1 TiB
    with pytest.raises(ValueError, match=r"allocate: the buffer is 7,785,676,800,000 B \(7,251.0 GiB\), more than "
                                         r"the .* B \(.* GiB\) of "):
        huge.allocate()


def test_allocate_fills_every_byte(rng):
    lay = CacheLayout(IndexerConfig(block_size=64), num_layers=2, num_blocks=3, attn_block_bytes=12)
    for fill in (0, SENTINEL, 0xFF, int(rng.integers(1, 255))):
        buf = lay.allocate(fill)
        assert buf.dtype == jnp.uint32 and buf.shape == (lay.total_words,)
        b = np.asarray(buf).view(np.uint8)
        assert b.size == lay.total_bytes
        assert np.all(b == fill), fill


# ---------------------------------------------------------------------------------
# inspection views
# ---------------------------------------------------------------------------------
def _spec_pool_offsets(base, page_rows, loc):
    """(key byte offset, scale byte offset) of pool slot loc, straight from docs/semantics.md 3.1."""
    page, row = loc // page_rows, loc % page_rows
    start = base + page * page_rows * 132
    return start + row * 128, start + page_rows * 128 + row * 4


def _spec_tail_offset(base, block_bytes, ring, block, slot, half):
    return base + block * block_bytes + half * ring * 256 + slot * 256


@pytest.mark.parametrize("block_size, n_spec", [(1152, 0), (1024, 1), (64, 0)])
def test_views_read_hand_written_bytes(rng, block_size, n_spec):
    """Bytes placed at the offsets of docs/semantics.md 3.1 with numpy come back through pool_keys/tail_ring."""
    cfg = IndexerConfig(block_size=block_size, num_spec_tokens=n_spec)
    lay = CacheLayout(cfg, num_layers=3, num_blocks=5, attn_block_bytes=4 * int(rng.integers(0, 300)))
    layer = int(rng.integers(0, 3))
    raw = np.full(lay.total_bytes, SENTINEL, np.uint8)
    base = lay.index_base_bytes(layer)
    n = lay.num_blocks * cfg.pools_per_block
    locs = rng.choice(n, size=min(n, 40), replace=False)
    keys = rng.integers(0, 256, size=(locs.size, 128), dtype=np.uint8)
    scales = rng.standard_normal(locs.size).astype(np.float32)
    for loc, k, sc in zip(locs, keys, scales):
        ko, so = _spec_pool_offsets(base, cfg.page_rows, int(loc))
        raw[ko:ko + 128] = k
        raw[so:so + 4] = np.frombuffer(sc.tobytes(), np.uint8)
    gk, gs = lay.pool_keys(raw.view(np.uint32), layer)
    assert gk.dtype == ml_dtypes.float8_e4m3fn and gk.shape == (n, 128) and gs.shape == (n,)
    np.testing.assert_array_equal(gk.view(np.uint8)[locs], keys)
    np.testing.assert_array_equal(gs[locs].view(np.uint32), scales.view(np.uint32))
    # untouched pool slots read back as the sentinel
    others = np.setdiff1d(np.arange(n), locs)
    assert np.all(gk.view(np.uint8)[others] == SENTINEL)

    # tail ring rows (separate buffer: the tail aliases the start of the indexer block)
    raw = np.full(lay.total_bytes, SENTINEL, np.uint8)
    want = rng.integers(0, 2**16, size=(2, lay.num_blocks, cfg.ring, 128), dtype=np.uint16)
    for half in (0, 1):
        for b in range(lay.num_blocks):
            for s in range(cfg.ring):
                o = _spec_tail_offset(base, cfg.index_block_bytes, cfg.ring, b, s, half)
                raw[o:o + 256] = want[half, b, s].view(np.uint8)
    tk, tg = lay.tail_ring(raw.view(np.uint32), layer)
    assert tk.dtype == ml_dtypes.bfloat16 and tk.shape == (lay.num_blocks, cfg.ring, 128)
    np.testing.assert_array_equal(tk.view(np.uint16), want[0])
    np.testing.assert_array_equal(tg.view(np.uint16), want[1])
    # the tail of block b is the first 2*ring*256 bytes of indexer block b
    for b in range(lay.num_blocks):
        a0, a1 = lay.block_byte_range(layer, b)
        assert np.all(raw[a0 + cfg.tail_block_bytes:a1] == SENTINEL)
        assert not np.all(raw[a0:a0 + cfg.tail_block_bytes] == SENTINEL)


def test_views_round_trip_reference_writes(rng):
    """Pools and tails written by the reference are where docs/semantics.md 3 says, and the views read them."""
    lay = refjit.SMALL_LAYOUT                      # kpool 4, ring 8, one 32-row page per block
    cfg = lay.config
    layer = 0
    R = cfg.kpool
    n_pools = refjit.SMALL_T // R
    key = random_rows(rng, R * n_pools)
    gate = random_rows(rng, R * n_pools)
    ape = random_ape(rng, R)
    # the tail block aliases its indexer block, so pools go to the other blocks (docs/semantics.md 3.5),
    # except the null block 0, which no writer touches
    blk = int(rng.integers(1, lay.num_blocks))
    pool_slots = np.arange(lay.num_blocks * cfg.pools_per_block)
    pool_slots = pool_slots[(pool_slots // cfg.pools_per_block != blk) & (pool_slots >= cfg.pools_per_block)]
    locs = rng.choice(pool_slots, size=n_pools, replace=False).astype(np.int32)
    slot = np.full(R * n_pools, -1, np.int32)
    slot[R - 1::R] = locs
    tslot = np.full(R * n_pools, -1, np.int32)
    tslot[-R:] = blk * cfg.ring + (np.arange(R) + 4) % cfg.ring       # positions 4..7 of one request
    cache = refjit.compress(lay.allocate(SENTINEL), lay, layer, key, gate, ape, slot)
    cache = refjit.seed(cache, lay, layer, key, gate, tslot)
    raw = refjit.as_bytes(cache)

    k = jnp.asarray(key).reshape(n_pools, R, 128)
    g = jnp.asarray(gate).reshape(n_pools, R, 128)
    q8, sc = nm.compress_pool([k[:, j] for j in range(R)], [g[:, j] for j in range(R)],
                              [jnp.asarray(ape[j]) for j in range(R)])
    q8 = np.asarray(q8).view(np.uint8)
    sc = np.asarray(sc)
    base = lay.index_base_bytes(layer)
    written = np.zeros(raw.size, bool)
    for i, loc in enumerate(locs):
        ko, so = _spec_pool_offsets(base, cfg.page_rows, int(loc))
        np.testing.assert_array_equal(raw[ko:ko + 128], q8[i])
        assert raw[so:so + 4].view(np.float32)[0].tobytes() == sc[i].tobytes()
        written[ko:ko + 128] = written[so:so + 4] = True
    for j in range(R):
        for half, rows in ((0, key), (1, gate)):
            o = _spec_tail_offset(base, cfg.index_block_bytes, cfg.ring, blk, (4 + j) % cfg.ring, half)
            np.testing.assert_array_equal(raw[o:o + 256], rows[-R + j].view(np.uint8))
            written[o:o + 256] = True
    assert np.all(raw[~written] == SENTINEL)

    gk, gs = lay.pool_keys(cache, layer)
    np.testing.assert_array_equal(gk.view(np.uint8)[locs], q8)
    np.testing.assert_array_equal(gs[locs].view(np.uint32), sc.view(np.uint32))
    tk, tg = lay.tail_ring(cache, layer)
    for j in range(R):
        np.testing.assert_array_equal(tk[blk, (4 + j) % cfg.ring].view(np.uint16), key[-R + j].view(np.uint16))
        np.testing.assert_array_equal(tg[blk, (4 + j) % cfg.ring].view(np.uint16), gate[-R + j].view(np.uint16))


# ---------------------------------------------------------------------------------
# summary / table
# ---------------------------------------------------------------------------------
def test_summary_and_table():
    cfg = IndexerConfig(num_spec_tokens=3)
    lay = CacheLayout(cfg, num_layers=11, num_blocks=800, attn_block_bytes=656 * 288)
    s = lay.summary()
    want = {
        "block_size_tokens": 1152, "kpool": 4, "num_spec_tokens": 3, "ring_tokens": 8,
        "pools_per_block": 288, "page_rows": 32, "pages_per_block": 9, "page_bytes": 4224,
        "index_block_bytes": 38016, "tail_block_bytes": 4096, "tail_block_stride_elems": 19008,
        "attn_block_bytes": 656 * 288, "num_layers": 11, "num_blocks": 800,
        "bytes_per_block_all_layers": 11 * (656 * 288 + 38016),
        "index_bytes_per_token_per_layer": 33.0,
        "tokens_that_fit": 799 * 1152,
        "total_bytes": lay.total_bytes,
    }
    assert s == want
    assert lay.total_bytes == -(-(11 * 800 * (656 * 288 + 38016)) // 4096) * 4096
    t = lay.table()
    lines = t.splitlines()
    assert len(lines) == len(want)
    for line, (k, v) in zip(lines, want.items()):
        label = k.replace("_", " ")
        assert line.startswith(label)
        val = f"{v:,}" if isinstance(v, int) else f"{v:g}"
        assert line.rstrip().endswith(val), (line, val)
    assert "38,016" in t and "920,448" in t
