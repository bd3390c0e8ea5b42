"""Host-side metadata (docs/semantics.md 4.1-4.3): page tables, the pool-granular compressed
slot mapping and the token-granular tail slot mapping. The expected (page, row)
of every pool is derived independently from the MANAGER block table (block of
block_size tokens), never through the page table, so a unit mix-up between
tokens, pools and pages (bugs B9-B11) shows."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from glm5_jax import metadata as md
from glm5_jax.config import IndexerConfig

# (kpool, block_size) -> page rows: 32-row pages, 64-row pages, one passthrough page
GEOMS = [
    pytest.param(IndexerConfig(kpool=4, block_size=1152), id="R4-P32x9"),
    pytest.param(IndexerConfig(kpool=4, block_size=1024), id="R4-P64x4"),
    pytest.param(IndexerConfig(kpool=4, block_size=2176), id="R4-P32x17"),
    pytest.param(IndexerConfig(kpool=4, block_size=128, num_spec_tokens=3), id="R4-P32x1"),
    pytest.param(IndexerConfig(kpool=16, block_size=1536), id="R16-P32x3"),
    pytest.param(IndexerConfig(kpool=16, block_size=2048), id="R16-P64x2"),
    pytest.param(IndexerConfig(kpool=4, block_size=64), id="R4-P16x1"),
]


def _expected_page_row(cfg, block_table, req, pos):
    """(page, row) of the pool holding token pos, from the manager block table."""
    mgr = block_table[req, pos // cfg.block_size]
    pool_in_block = (pos % cfg.block_size) // cfg.kpool
    page = mgr * cfg.pages_per_block + pool_in_block // cfg.page_rows
    return page, pool_in_block % cfg.page_rows


def _random_batch(rng, cfg, n_req, max_len):
    lens = rng.integers(1, max_len + 1, n_req)
    q = np.minimum(lens, rng.integers(1, max_len + 1, n_req))          # query lengths <= seq lens
    width = int(-(-lens.max() // cfg.block_size))
    ids = rng.permutation(np.arange(1, n_req * width * 3 + 2))     # distinct blocks, 0 = null
    bt = np.zeros((n_req, width), np.int64)
    k = 0
    for i in range(n_req):
        need = -(-lens[i] // cfg.block_size)
        bt[i, :need] = ids[k:k + need]
        k += need
    return lens, q, bt


def test_page_table_pages_dense(rng):
    cfg = IndexerConfig(block_size=1152)
    bt = rng.integers(0, 800, (3, 5))
    pt = md.page_table_pages(bt, cfg)
    assert pt.shape == (3, 45) and pt.dtype == np.int32
    for i in range(3):
        for j in range(45):
            assert pt[i, j] == bt[i, j // 9] * 9 + j % 9
    # 64-row pages: 4 per block
    cfg = IndexerConfig(block_size=1024)
    pt = md.page_table_pages(bt, cfg)
    np.testing.assert_array_equal(pt, (bt[:, :, None] * 4 + np.arange(4)).reshape(3, 20))
    with pytest.raises(ValueError, match=r"block table must be \[B, max_blocks\]"):
        md.page_table_pages(bt[0], cfg)


@pytest.mark.parametrize("cfg", GEOMS)
def test_compressed_slot_round_trip(rng, cfg):
    for _ in range(5):
        lens, q, bt = _random_batch(rng, cfg, n_req=int(rng.integers(1, 6)), max_len=3 * cfg.block_size + 7)
        pos = md.token_positions(lens, q)
        req = md.token_request_index(q)
        slot = md.compressed_slot_mapping(pos, req, md.page_table_pages(bt, cfg), cfg)
        assert slot.dtype == np.int32 and slot.shape == pos.shape
        completes = (pos + 1) % cfg.kpool == 0
        assert np.all(slot[~completes] == -1)
        assert np.all(slot[completes] >= 0)
        for s, p, r in zip(slot[completes], pos[completes], req[completes]):
            page, row = _expected_page_row(cfg, bt, r, p)
            assert (s // cfg.page_rows, s % cfg.page_rows) == (page, row)
            # docs/semantics.md 4.2 manager-block form (dense layer-outer layout)
            assert s == bt[r, p // cfg.block_size] * cfg.pools_per_block + (p // cfg.kpool) % cfg.pools_per_block
        # distinct pools of distinct requests never share a slot
        v = slot[slot >= 0]
        assert np.unique(v).size == v.size


@settings(deadline=None, max_examples=40)
@given(data=st.data())
def test_compressed_slot_round_trip_property(data):
    kpool = data.draw(st.sampled_from([4, 16]))
    s_rows = data.draw(st.sampled_from([16, 32, 64, 96, 128, 160, 288, 544, 1088]))
    try:
        cfg = IndexerConfig(kpool=kpool, block_size=kpool * s_rows)
    except ValueError:
        return
    n_blocks = data.draw(st.integers(1, 6))
    row = data.draw(st.lists(st.integers(1, 5000), min_size=n_blocks, max_size=n_blocks, unique=True))
    bt = np.array([row])
    length = data.draw(st.integers(1, n_blocks * cfg.block_size))
    pos = np.array(data.draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=40)))
    pos = (pos // kpool) * kpool + kpool - 1                            # completing tokens only
    pos = pos[pos < length]
    if pos.size == 0:
        return
    slot = md.compressed_slot_mapping(pos, np.zeros_like(pos), md.page_table_pages(bt, cfg), cfg)
    for s, p in zip(slot, pos):
        assert (s // cfg.page_rows, s % cfg.page_rows) == _expected_page_row(cfg, bt, 0, p)


@pytest.mark.parametrize("cfg", [IndexerConfig(block_size=1152), IndexerConfig(block_size=1024),
                                 IndexerConfig(kpool=16, block_size=2048)], ids=["P32", "P64", "R16"])
def test_positions_beyond_2pow17(rng, cfg):
    """Long prompts (bug B11 appeared at 131,328 tokens): slots stay exact past 2**17 tokens."""
    L = 2**17 + int(rng.integers(1, 3 * cfg.block_size))
    n = -(-L // cfg.block_size)
    bt = rng.choice(np.arange(1, 4 * n), size=n, replace=False)[None, :]
    pages = md.page_table_pages(bt, cfg)
    pos = np.concatenate([np.arange(2**17 - 64, L), rng.integers(0, L, 200)])
    pos = pos[(pos + 1) % cfg.kpool == 0]
    slot = md.compressed_slot_mapping(pos, np.zeros_like(pos), pages, cfg)
    page, row = _expected_page_row(cfg, bt, 0, pos)
    np.testing.assert_array_equal(slot // cfg.page_rows, page)
    np.testing.assert_array_equal(slot % cfg.page_rows, row)
    assert slot.max() < (bt.max() + 1) * cfg.pools_per_block
    # self-check: B11's mapper (page height 64 // kpool pools from the 64-token kernel block,
    # with the page-unit table) disagrees, so the comparison above is sharp
    cpos, h = pos // cfg.kpool, 64 // cfg.kpool
    col = cpos // h
    wrong = np.where(col < pages.shape[1], pages[0, np.minimum(col, pages.shape[1] - 1)] * h + cpos % h, -2)
    assert np.mean(wrong != slot) > 0.5


def test_short_requests_and_multiples_of_kpool():
    cfg = IndexerConfig(kpool=4, block_size=1152)
    bt = np.array([[7], [9], [11]])
    pages = md.page_table_pages(bt, cfg)
    # request 0: 3 tokens (< kpool), request 1: 8 tokens (multiple), request 2: 9 tokens
    lens = np.array([3, 8, 9])
    pos = md.token_positions(lens, lens)
    req = md.token_request_index(lens)
    slot = md.compressed_slot_mapping(pos, req, pages, cfg)
    np.testing.assert_array_equal(slot[:3], [-1, -1, -1])
    np.testing.assert_array_equal(slot[3:11], [-1, -1, -1, 9 * 288, -1, -1, -1, 9 * 288 + 1])
    np.testing.assert_array_equal(slot[11:], [-1, -1, -1, 11 * 288, -1, -1, -1, 11 * 288 + 1, -1])
    assert md.context_pools(lens, cfg).tolist() == [0, 2, 2]
    assert md.context_pools([-3, 0, 4, 1151], cfg).tolist() == [0, 0, 1, 287]


def test_padding_entries():
    cfg = IndexerConfig(kpool=4, block_size=1152)
    lens = np.array([8, 4])
    q = np.array([4, 4])
    pos = md.token_positions(lens, q, num_tokens_padded=12)
    req = md.token_request_index(q, num_tokens_padded=12)
    np.testing.assert_array_equal(pos, [4, 5, 6, 7, 0, 1, 2, 3, -1, -1, -1, -1])
    np.testing.assert_array_equal(req, [0, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1, -1])
    assert pos.dtype == np.int32 and req.dtype == np.int32
    pages = md.page_table_pages(np.array([[3], [5]]), cfg)
    slot = md.compressed_slot_mapping(pos, req, pages, cfg)
    np.testing.assert_array_equal(slot, [-1, -1, -1, 3 * 288 + 1, -1, -1, -1, 5 * 288, -1, -1, -1, -1])
    tslot = md.tail_slot_mapping(pos, req, np.array([20, 21]), cfg)
    np.testing.assert_array_equal(tslot, [80, 81, 82, 83, 84, 85, 86, 87, -1, -1, -1, -1])
    # a padding token that happens to "complete a pool" (pos -1 -> (pos+1) % R == 0) never maps
    slot = md.compressed_slot_mapping(np.array([-1, 3]), np.array([0, -1]), pages, cfg)
    np.testing.assert_array_equal(slot, [-1, -1])
    with pytest.raises(ValueError, match="do not fit in a padded batch"):
        md.token_positions(lens, q, num_tokens_padded=7)
    with pytest.raises(ValueError, match="query length exceeds"):
        md.token_positions([3], [4])
    with pytest.raises(ValueError, match="same shape"):
        md.token_positions([3, 4], [3])
    with pytest.raises(ValueError, match=">= 0"):
        md.token_request_index([2, -1])


def test_position_beyond_table_raises():
    cfg = IndexerConfig(kpool=4, block_size=1152)
    pages = md.page_table_pages(np.array([[3, 4]]), cfg)               # 2 blocks = 2304 tokens
    ok = md.compressed_slot_mapping(np.array([2303]), np.array([0]), pages, cfg)
    assert ok[0] == 4 * 288 + 287
    with pytest.raises(ValueError, match="beyond its request's page table"):
        md.compressed_slot_mapping(np.array([2307]), np.array([0]), pages, cfg)
    # a non-completing token beyond the table does not need a pool slot
    assert md.compressed_slot_mapping(np.array([2304]), np.array([0]), pages, cfg)[0] == -1


@pytest.mark.parametrize("cfg", [IndexerConfig(), IndexerConfig(num_spec_tokens=3),
                                 IndexerConfig(kpool=16, block_size=2048, num_spec_tokens=1)],
                         ids=["ring4", "ring8", "R16-ring32"])
def test_tail_slot_round_trip(rng, cfg):
    lens = rng.integers(1, 3 * cfg.block_size, 6)
    q = np.minimum(lens, rng.integers(1, 50, 6))
    pad = int(q.sum() + rng.integers(0, 9))
    pos = md.token_positions(lens, q, pad)
    req = md.token_request_index(q, pad)
    tails = rng.choice(np.arange(1, 1000), size=6, replace=False)
    tslot = md.tail_slot_mapping(pos, req, tails, cfg)
    assert tslot.dtype == np.int32
    real = req >= 0
    assert np.all(tslot[~real] == -1)
    np.testing.assert_array_equal(tslot[real], tails[req[real]] * cfg.ring + pos[real] % cfg.ring)
    # block and ring slot recovered from the tail slot
    np.testing.assert_array_equal(tslot[real] // cfg.ring, tails[req[real]])
    # a request without a tail block (null block 0) gets no tail slots
    tails[0] = 0
    t0 = md.tail_slot_mapping(pos, req, tails, cfg)
    assert np.all(t0[req == 0] == -1) and np.all(t0[req > 0] == tslot[req > 0])


def test_long_positions_tail_and_slot_int32():
    cfg = IndexerConfig(num_spec_tokens=3)
    pos = np.array([2**20 - 1, 2**20, 2**17 + 5], np.int64)
    t = md.tail_slot_mapping(pos, np.zeros(3, np.int64), np.array([799]), cfg)
    np.testing.assert_array_equal(t, 799 * 8 + pos % 8)


def test_pool_on_null_block_page_is_an_error():
    """A table padding entry (block 0, the null block) must never receive a pool."""
    cfg = IndexerConfig()
    pages = md.page_table_pages(np.array([[5, 0]]), cfg)          # second block missing
    pos = np.array([cfg.block_size + cfg.kpool - 1])                 # first pool of block column 1
    with pytest.raises(ValueError, match="null block"):
        md.compressed_slot_mapping(pos, np.array([0]), pages, cfg)
    ok = md.compressed_slot_mapping(np.array([cfg.kpool - 1]), np.array([0]), pages, cfg)
    assert ok[0] == 5 * cfg.pools_per_block


def test_builders_refuse_silent_coercions():
    """Float or bool arrays (np.asarray(x, int64) would truncate them, or turn them into 0 / 1),
    request ids without a table row, mismatched shapes and values past int32 are refused
    with the builder's name; integer arrays of any width and lists of ints are taken."""
    cfg = IndexerConfig()
    pages = md.page_table_pages([[3, 4]], cfg)
    np.testing.assert_array_equal(pages, md.page_table_pages(np.array([[3, 4]], np.uint16), cfg))
    bad = [
        (lambda: md.page_table_pages(np.array([[3.0, 4.0]]), cfg), r"page_table_pages: block table must hold integers, "
                                                                    r"got dtype float64"),
        (lambda: md.page_table_pages([[True, False]], cfg), r"block table must hold integers, got dtype bool"),
        (lambda: md.page_table_pages([[2**31 // 9 + 1]], cfg), r"page_table_pages: page ids do not fit in int32"),
        (lambda: md.page_table_pages([[3]], "cfg"), r"page_table_pages: config must be an IndexerConfig, got str"),
        (lambda: md.token_positions([8.5], [4]), r"token_positions: seq_lens must hold integers, got dtype float64"),
        (lambda: md.token_request_index([4], num_tokens_padded=8.0),
         r"metadata.num_tokens_padded must be an int, got 8.0"),
        (lambda: md.compressed_slot_mapping(np.array([3.0]), np.array([0]), pages, cfg),
         r"compressed_slot_mapping: positions must hold integers, got dtype float64"),
        (lambda: md.compressed_slot_mapping(np.array([3]), np.array([1]), pages, cfg),
         r"compressed_slot_mapping: request index 1 has no row in the page table \(1 rows\)"),
        (lambda: md.compressed_slot_mapping(np.array([3, 7]), np.array([0]), pages, cfg),
         r"compressed_slot_mapping: positions \(2,\) and request_index \(1,\) must have the same shape"),
        (lambda: md.tail_slot_mapping(np.array([3]), np.array([2]), np.array([5, 6]), cfg),
         r"tail_slot_mapping: request index 2 has no row in the tail blocks \(2 rows\)"),
        (lambda: md.tail_slot_mapping(np.array([3]), np.array([0]), np.array([5.0]), cfg),
         r"tail_slot_mapping: tail_blocks must hold integers"),
        (lambda: md.tail_slot_mapping(np.array([3]), np.array([0]), np.array([2**30]), cfg),
         r"tail_slot_mapping: tail slots do not fit in int32"),
        (lambda: md.context_pools([7.9], cfg), r"context_pools: seq_lens must hold integers"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
    assert md.context_pools(np.array([7, 9], np.int16), cfg).tolist() == [1, 2]
    assert md.token_positions([], []).size == 0 and md.token_request_index([], np.int64(3)).tolist() == [-1] * 3
