"""The tensor-core read path (implementation="triton": paged_logits, topk_pools, select_tokens).

Accuracy contract (docs/design.md): both the kernel and the XLA reference multiply
exact fp8 products and sum them in f32, so each is within

    E[i, m] = (D + H + 2) * 2**-23 * kscale[m] * sum_h |w'[i, h]| * sum_d |q8[i, h, d] * K8[m, d]|

of the exact logit (D = 128 dims, H = padded heads; a summation of n terms in f32
is off by at most (n - 1) * 2**-24 of the sum of magnitudes, doubled for
accumulators that truncate, and ReLU and the power-of-two scale add nothing), and
within 2 E of each other. A selected set must equal the golden (exact) selection
of every row whose gap between the k-th and (k+1)-th best golden logit exceeds
2 * 2 E of the row; a difference anywhere else fails.

CPU tests (CI): the host-side planning (chunk rows under the workspace bound, the
page entries the kernel reads), the error off the GPU, the workspace bound of the
XLA path, the bound E against an f64 golden. GPU tests (marked gpu): the kernels
compiled, against the f64 golden and the reference.
"""
import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax import reference as ref
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from pallas_kernels.core import addressing as addr
from pallas_kernels.read import workspace
from pallas_kernels.triton_lang import _call
from test_read_path import ascending_then_empty, np_expand, np_topk, random_cache, random_queries, random_tables

ON_GPU = jax.default_backend() == "gpu"
D = 128
U = 2.0 ** -23


# ---------------------------------------------------------------------------------
# the golden scores and the bound
# ---------------------------------------------------------------------------------
def golden(cache, layout, layer, q8, w, table, ctx):
    """(exact logits [B, n, M] f64 with -inf outside context, the bound E [B, n, M])."""
    s = layout.strides(layer)
    k8, ks, ok = (np.asarray(x) for x in jax.jit(ref.gather_pools, static_argnums=1)(cache, s, jnp.asarray(table)))
    k = k8.astype(np.float64)                                        # [B, M, 128]
    q = np.asarray(q8).astype(np.float64)                            # [B, n, H, 128]
    wf = np.asarray(w, np.float64)
    kss = ks.astype(np.float64)
    dots = np.einsum("bnhd,bmd->bnhm", q, k) * kss[:, None, None, :]
    lg = np.einsum("bnh,bnhm->bnm", wf, np.maximum(dots, 0.0))
    mag = np.einsum("bnh,bnhm->bnm", np.abs(wf), np.einsum("bnhd,bmd->bnhm", np.abs(q), np.abs(k))) \
        * kss[:, None, :]
    e = (D + q.shape[2] + 2) * U * mag
    m = np.arange(k.shape[1])
    live = ok[:, None, :] & (m[None, None, :] < np.asarray(ctx)[..., None])
    return np.where(live, lg, -np.inf), np.where(live, e, 0.0)


def decided_rows(gold, e, lengths, k):
    """Rows whose selection the contract decides: the k-th and (k+1)-th best golden
    logits are more than 2 * 2 E of the row apart (rows with <= k pools always)."""
    rows = []
    for i in range(gold.shape[0]):
        n = int(lengths[i])
        if n <= k:
            rows.append(i)
            continue
        v = np.sort(gold[i, :n])[::-1]
        if v[k - 1] - v[k] > 4 * e[i, :n].max():
            rows.append(i)
    return np.asarray(rows, np.int64)


def tc_case(rng, block_size=1152, heads=32, b=1, n=96, max_pages=9, layers=1):
    layout = CacheLayout(IndexerConfig(block_size=block_size), num_layers=layers, num_blocks=6)
    layer = layers - 1
    cache = random_cache(rng, layout, layer=layer)
    s = layout.strides(layer)
    q8, wf = random_queries(rng, b, n, heads)
    max_pages = min(max_pages, s.num_blocks * s.pages_per_block)
    table = random_tables(rng, layout, layer, b, max_pages)
    ctx = rng.integers(0, max_pages * s.page_rows + 1, size=(b, n)).astype(np.int32)
    ctx[0, 0] = 0                                               # a row that sees nothing
    ctx[0, -1] = max_pages * s.page_rows                        # one that sees every pool
    return layout, layer, s, cache, q8, wf, table, ctx


# ---------------------------------------------------------------------------------
# CPU: planning, errors, the bound
# ---------------------------------------------------------------------------------
def test_rows_per_chunk_keeps_the_workspace_bound(rng):
    for _ in range(200):
        n_rows = int(rng.integers(1, 1 << 21))
        n_cols = int(rng.integers(1, 1 << 19))
        k = int(rng.choice([1, 7, 64, 512, 2048]))
        batch = int(rng.integers(1, 9))
        tokens = int(rng.choice([0, 4 * k + 3]))                  # the split top-k's token columns
        per_row = batch * workspace.chunk_row_bytes(n_cols, k, tokens)
        assert per_row == batch * (workspace.chunk_row_bytes(n_cols, k) + 4 * tokens)
        ws = int(rng.integers(per_row, per_row * 5000))
        c = workspace.rows_per_chunk(n_rows, n_cols, k, batch, ws, tokens_per_row=tokens)
        assert 1 <= c <= n_rows
        assert c * per_row <= ws                                 # the bound holds
        assert c == n_rows or (c + 1) * per_row > ws             # and is used, not undershot
    # the default bound: 1 GiB; a 1M-token prompt (262144 pools) still chunks
    c = workspace.rows_per_chunk(1 << 20, 1 << 18, 512)
    assert c * workspace.chunk_row_bytes(1 << 18, 512) <= workspace.DEFAULT_WORKSPACE_BYTES and c >= 1


def test_rows_per_chunk_refuses_a_bound_below_one_row():
    per_row = workspace.chunk_row_bytes(1000, 512)
    with pytest.raises(ValueError, match="does not hold one query row"):
        workspace.rows_per_chunk(10, 1000, 512, 1, per_row - 1)
    for bad in (0, -5, 1.5, True, "1"):
        with pytest.raises(ValueError, match="positive int"):
            workspace.rows_per_chunk(10, 1000, 512, 1, bad)


def test_topk_scratch_width_is_the_next_power_of_two():
    for k, kp in ((1, 1), (2, 2), (3, 4), (512, 512), (513, 1024), (2048, 2048)):
        assert workspace.padded_k(k) == kp
        cap = workspace.MAXIMA_GROUP_POOLS * kp
        assert workspace.candidate_cap(k) == cap
        assert workspace.topk_scratch_bytes_per_row(k) == (2 * kp + cap) * 8 + cap * 4


def test_maxima_groups_partition_each_step():
    """Every column of a 64-column step is in exactly one of its 8 groups, each group within
    one 16-column page (P >= 16), and maxima_cols holds the groups of every step a row of
    n columns touches."""
    per_step = workspace.MAXIMA_STEP_POOLS // workspace.MAXIMA_GROUP_POOLS
    for step in range(3):
        cols = [c for g in range(step * per_step, (step + 1) * per_step) for c in workspace.group_columns(g)]
        assert sorted(cols) == list(range(step * 64, step * 64 + 64))
        for g in range(step * per_step, (step + 1) * per_step):
            assert len({c // 16 for c in workspace.group_columns(g)}) == 1
            assert all(group_of(c) == g for c in workspace.group_columns(g))
    for n in (1, 63, 64, 65, 1000, 32832):
        groups = workspace.maxima_cols(n)
        assert groups % per_step == 0 and max(workspace.group_columns(groups - 1)) >= n - 1
        assert groups == per_step or max(workspace.group_columns(groups - per_step - 1)) < n


def sample_guess(x, length, k):
    """The dense top-k's guess for a row of scores (topk_sample, in numpy): the top 16
    bits of the sample's t-th best key (0 for an empty row)."""
    n = int(np.clip(length, 0, x.shape[0]))
    sampled_pools = workspace.sample_pools(x.shape[0], k)         # sized by the row's columns
    stride, chunk = workspace.sample_stride(n, sampled_pools), workspace.sample_chunk_pools(sampled_pools)
    i = np.arange(sampled_pools)
    col = (i // chunk) * stride + i % chunk
    col = col[col < n]
    t = workspace.sample_rank(n, col.size, k)
    if t == 0:
        return np.uint32(0)
    keys = np.sort(np.asarray(ref.order_key(jnp.asarray(x[col]))))[::-1]
    return keys[t - 1] & np.uint32(0xFFFF0000)


@pytest.mark.parametrize("n, k", [(131072, 512), (131072, 2048), (32768, 512), (32768, 2048), (16384, 512),
                                  (16500, 512), (262144, 512), (262144, 2048), (1 << 20, 2048), (9000, 2048)])
def test_dense_topk_guess_lets_about_2k_scores_through(rng, n, k):
    """The sampled guess of topk_pools' sampled form lets through at least k and at
    most the candidates the select launch holds (``workspace.dense_candidates``, 4 k)
    of a row of random scores, so the row is selected from its candidates, not walked
    whole (a row sampled whole gets a floor: at least k reach it). The guess aims at
    about 2 k: at most 3 k reach it in the median of three rows (150 rows of 262,144
    scores at k = 512: median 1,054, largest 1,449; a rare row lets more through, such
    as 1,600 with GLM5_SEED=2104895603)."""
    width = workspace.dense_candidates(k)
    assert workspace.dense_topk_takes(1, n, k)
    reaches = []
    for _ in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        keys = np.asarray(ref.order_key(jnp.asarray(x)))
        reaches.append(int((keys >= sample_guess(x, n, k)).sum()))
        assert k <= reaches[-1] <= width, reaches
    assert np.median(reaches) <= 3 * k, reaches


def test_dense_topk_sample_planning():
    """The sample: 64 runs spread evenly over the row (the whole row, or its first columns
    when the row is too short for a stride of more than one run); its size: the least
    power of two from 2048 that ranks the guess 128 deep, at most 16,384; its rank:
    exact for a whole row, 2 k scaled otherwise."""
    assert workspace.sample_chunk_pools(16384) == 256 and workspace.sample_chunk_pools(2048) == 32
    assert workspace.sample_stride(131072, 16384) == 2048
    assert workspace.sample_stride(131072, 4096) == 2048                # runs of 64 columns
    assert workspace.sample_stride(8192, 16384) == 256                  # whole row
    assert workspace.sample_stride(100, 16384) == 256
    assert workspace.sample_stride(1 << 20, 16384) == 16384
    assert workspace.sample_stride(16000, 16384) == 256                 # too short: the first 16,384 columns
    assert workspace.sample_stride(16000, 2048) == 224                  # 16000 // 64 rounded down to runs of 32
    assert workspace.sample_pools(131072, 512) == 16384                 # rank 128
    assert workspace.sample_pools(131072, 2048) == 4096                 # rank 128
    assert workspace.sample_pools(262144, 2048) == 8192
    assert workspace.sample_pools(1 << 20, 2048) == 16384               # capped: rank 64
    assert workspace.sample_pools(1 << 20, 512) == 16384                # capped: rank 16
    assert workspace.sample_pools(8192, 512) == 2048                    # rank 256 at the least sample
    assert workspace.sample_pools(1000, 64) == 2048                     # the whole row
    for n in (4097, 9000, 20000, 131072, 262144, 1 << 20):
        for k in (64, 512, 1024, 2048):
            m = workspace.sample_pools(n, k)
            assert m & (m - 1) == 0 and workspace.SAMPLE_MIN_POOLS <= m <= workspace.SAMPLE_POOLS
            assert (m == workspace.SAMPLE_POOLS or m >= n
                    or workspace.sample_rank(n, m, k) >= workspace.SAMPLE_RANK_AIM)
            assert m == workspace.SAMPLE_MIN_POOLS or workspace.sample_rank(n, m // 2, k) < workspace.SAMPLE_RANK_AIM
    assert workspace.sample_rank(8000, 8000, 512, 2) == 512            # whole row: a floor
    assert workspace.sample_rank(300, 300, 512, 2) == 300
    assert workspace.sample_rank(131072, 8192, 512, 2) == 64
    assert workspace.sample_rank(131072, 8192, 2048, 2) == 256
    assert workspace.sample_rank(20000, 8192, 2048, 2) == 1678         # ceil(2 * 2048 * 8192 / 20000)
    assert workspace.sample_rank(0, 0, 512, 2) == 0


def test_dense_topk_takes_rows_past_the_registers_with_a_deep_sample():
    """The sampled form takes rows longer than the register form, up to a grid axis of
    them, while its sample ranks the guess at least MIN_SAMPLE_RANK deep (1M tokens
    = 262144 pools at k = 512; 1M pools at k = 2048)."""
    reg = workspace.REGISTER_ROW_POOLS
    assert not workspace.dense_topk_takes(64, reg, 512) and workspace.dense_topk_takes(64, reg + 1, 512)
    many = workspace.DENSE_MANY_ROWS                             # many short rows: one program each
    assert not workspace.dense_topk_takes(many, 2 * reg, 512) and workspace.dense_topk_takes(many - 1, 2 * reg, 512)
    assert workspace.dense_topk_takes(many, 2 * reg + 1, 512)
    assert workspace.dense_topk_takes(1, 131072, 512)
    assert workspace.dense_topk_takes(workspace.MAX_GRID_ROWS, 131072, 512)
    assert not workspace.dense_topk_takes(0, 131072, 512)
    assert not workspace.dense_topk_takes(workspace.MAX_GRID_ROWS + 1, 131072, 512)
    assert workspace.dense_topk_takes(64, 262144, 512) and not workspace.dense_topk_takes(64, 270000, 512)
    assert workspace.dense_topk_takes(64, 1 << 20, 2048) and not workspace.dense_topk_takes(64, 1080000, 2048)
    for n in (reg + 1, 9000, 16384, 20000, 131072, 262144):
        assert workspace.sample_rank(n, min(n, workspace.sample_pools(n, 512)), 512) >= workspace.MIN_SAMPLE_RANK


def test_split_planning_covers_each_row_and_fills_the_gpu(rng):
    """The split top-k's spans cover every column once, in whole tiles, with about
    SPLIT_PROGRAMS programs where the rows are long enough; the logits' pages per program
    shrink only while the grid is short of the programs asked for; the floor's maxima stay within
    FLOOR_MAXIMA up to 512k pools."""
    mp, sp = workspace.LOGITS_MIN_PROGRAMS, workspace.SPLIT_PROGRAMS
    for _ in range(300):
        rows = int(rng.integers(1, 300))
        n = int(rng.integers(0, 1 << 19))
        block = int(rng.choice([256, 512, 1024]))
        spans, span_pools = workspace.split_spans(rows, n, block)
        assert span_pools % block == 0 and spans >= 1
        assert spans * span_pools >= n and (spans - 1) * span_pools < max(n, 1)
        blocks = max(1, -(-n // block))
        assert 2 * spans >= min(-(-sp // rows), blocks)           # spans rounded to whole tiles
        assert spans <= -(-sp // rows)
        if rows >= sp:
            assert spans == 1
        g = int(rng.choice([1, 2, 4]))
        max_pages = int(rng.integers(1, 1 << 14))
        other = int(rng.integers(1, 2000))
        assert workspace.logits_pages_per_program(max_pages, other, g, 64, 0) == 64     # prefill: never
        pages = workspace.logits_pages_per_program(max_pages, other, g, 64, mp)
        assert g <= pages <= 64 and pages & (pages - 1) == 0
        programs = other * -(-max_pages // pages)
        if pages > g:
            assert programs >= mp                                # halved only while short of programs
        if pages < 64:
            assert other * -(-max_pages // (2 * pages)) < mp
    for n in (1, 4096, 32832, 65536, 65537, 524288):
        p = workspace.split_maxima_pools(n)
        assert workspace.maxima_cols(n, p) <= workspace.FLOOR_MAXIMA
        assert p == workspace.MAXIMA_GROUP_POOLS or workspace.maxima_cols(n) > workspace.FLOOR_MAXIMA
    assert workspace.maxima_cols(130, 64) == 3 and workspace.maxima_cols(130, 8) == 24
    with pytest.raises(ValueError, match="8 or 64"):
        workspace.maxima_cols(130, 16)
    for _ in range(300):                                         # the rank launch's programs per row
        rows, k, tile = int(rng.integers(1, 5000)), int(rng.choice([1, 64, 512, 2048])), int(rng.choice([32, 64]))
        cap = workspace.candidate_cap(k)
        t = workspace.rank_programs(rows, cap, tile)
        assert 1 <= t <= -(-cap // tile)                         # never a program without a tile to rank
        assert t == 1 or rows * t <= sp                          # one wave of SPLIT_PROGRAMS at most
        assert t == -(-cap // tile) or rows * (t + 1) > sp       # and no fewer than fit in it


@pytest.mark.parametrize("block_size", [1152, 512, 256])
def test_page_entries_address_every_row_of_a_page(rng, block_size):
    """The kernel reads row r of a page at (entry's first key word + r * KEY_WORDS) and
    (first scale word + r): the same words addressing gives row by row."""
    layout = CacheLayout(IndexerConfig(block_size=block_size), num_layers=3, num_blocks=7, attn_block_bytes=64)
    s = layout.strides(2)
    n_pages = addr.num_pages(s)
    pages = np.concatenate([rng.integers(0, n_pages, 20), [-1, n_pages, n_pages + 7, 0]]).astype(np.int32)
    ent = np.asarray(addr.page_entries(s, jnp.asarray(pages)))
    for i, p in enumerate(pages):
        if not 0 <= p < n_pages:
            assert ent[i, 0] == -1
            continue
        kw = int(ent[i, 0]) * 1024 + int(ent[i, 1])
        sw = int(ent[i, 2]) * 1024 + int(ent[i, 3])
        for r in range(s.page_rows):
            assert kw + r * addr.KEY_WORDS == addr.global_word(s, addr.page_key_words(s, int(p), r))
            assert sw + r == addr.global_word(s, addr.page_scale_words(s, int(p), r))


def test_tc_geometry_rules():
    workspace.check_tc_geometry(32, 32, True)
    with pytest.raises(ValueError, match="page_rows"):
        workspace.check_tc_geometry(48, 32, True)
    with pytest.raises(ValueError, match="heads"):
        workspace.check_tc_geometry(32, 16, True)
    with pytest.raises(ValueError, match="aligned"):
        workspace.check_tc_geometry(32, 32, False)


@pytest.mark.skipif(ON_GPU, reason="the CPU's error; the GPU runs the kernels below")
def test_triton_read_ops_off_the_gpu_name_the_alternatives(rng):
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, n=4)
    pos = jnp.asarray(np.arange(4)[None, :], jnp.int32)
    calls = {
        "paged_logits": lambda: ops.paged_logits(cache, layout, layer, q8, wf, jnp.asarray(table), jnp.asarray(ctx),
                                                 implementation="triton"),
        "topk_pools": lambda: ops.topk_pools(jnp.zeros((2, 8)), jnp.ones((2,), jnp.int32), 4,
                                             implementation="triton"),
        "select_tokens": lambda: ops.select_tokens(cache, layout, layer, q8, wf, jnp.asarray(table), pos,
                                                   implementation="triton", short_context=False),
    }
    for op, call in calls.items():
        with pytest.raises(_call.TritonUnavailableError, match=rf"{op}: .*'pallas'.*'xla'"):
            call()
    # the default never needs jax_triton off the GPU
    assert ops.default_implementation("select_tokens") == "xla"


@pytest.mark.gpu
def test_tc_default_is_one_implementation_whatever_the_batch(rng):
    """select_tokens(implementation=None) traces the Pallas chain for decode rows at
    every batch size, the split top-k's launches only where "triton" is named, and the
    tensor-core path for prefill rows."""
    _require_triton()
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, b=128, n=ops.TC_MIN_ROWS, max_pages=40)
    n_cols = table.shape[1] * s.page_rows
    pos = jnp.full((128, ops.TC_MIN_ROWS), n_cols * layout.config.kpool - 1, jnp.int32)
    for b, n, impl in ((1, 1, None), (2, 1, None), (128, 1, None), (2, 1, "triton"), (1, ops.TC_MIN_ROWS, None)):
        text = str(jax.make_jaxpr(lambda c, q, w, t, p: ops.select_tokens(c, layout, layer, q, w, t, p,
                                                                           short_context=False,
                                                                           implementation=impl))(
            cache, q8[:b, :n], wf[:b, :n], jnp.asarray(table[:b]), pos[:b, :n]))
        tc = impl == "triton" or n >= ops.TC_MIN_ROWS
        assert ("kpool_paged_logits_tc" in text) == tc, (b, n, impl)
        assert ("kpool_topk_rank" in text) == (tc and n < ops.TC_MIN_ROWS), (b, n, impl)
        assert bool(re.search(r"kpool_paged_logits(?!_tc)", text)) == (not tc), (b, n, impl)   # the Pallas logits


def test_tc_default_reads_only_the_rows_per_request():
    """The default's choice is a function of the query rows per request alone (never of
    the batch or the tables), so a request's rows take one implementation whatever they
    are batched with; off the GPU it is the reference."""
    assert [ops.tc_select_by_default(n) for n in (1, 2, 4, ops.TC_MIN_ROWS - 1)] == [False] * 4
    assert all(ops.tc_select_by_default(n) for n in (ops.TC_MIN_ROWS, ops.TC_MIN_ROWS + 1, 1 << 20))
    layout = CacheLayout(IndexerConfig(block_size=1152), num_layers=1, num_blocks=6)
    for n in (1, ops.TC_MIN_ROWS):
        got = ops.default_select_implementation(layout, 0, 32, n)
        if not ON_GPU:
            assert got == "xla"
        else:
            assert got == ("triton" if n >= ops.TC_MIN_ROWS and _call.available() else "pallas")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="rows_per_request must be a positive int"):
            ops.default_select_implementation(layout, 0, 32, bad)


def test_topk_default_rule():
    """topk_pools' default takes the Triton top-k only inside the measured range (k =
    512-2048, 8k-256k pools): at k = 2048 over at least TC_TOPK_MIN_ROWS rows, and at
    any k of the range over at least TC_TOPK_MANY_ROWS rows of at most
    TC_TOPK_SHORT_POOLS pools (docs/benchmarks.md: the Triton top-k was faster in
    each of those measured shapes); there, the Triton top-k is the sampled form or,
    for many rows of at most 8192 pools, one program per row, never the whole-row
    walk of few long rows."""
    rows, many, short = ops.TC_TOPK_MIN_ROWS, ops.TC_TOPK_MANY_ROWS, ops.TC_TOPK_SHORT_POOLS
    assert ops.tc_topk_by_default(rows, 1 << 18, 2048) and ops.tc_topk_by_default(rows, 8192, 2048)
    assert not ops.tc_topk_by_default(rows - 1, 8192, 2048) and not ops.tc_topk_by_default(1, 131072, 2048)
    assert not ops.tc_topk_by_default(many - 1, 8192, 1024) and not ops.tc_topk_by_default(rows, 8192, 512)
    assert ops.tc_topk_by_default(many, short, 512) and ops.tc_topk_by_default(4096, 8192, 1024)
    assert not ops.tc_topk_by_default(many, short + 1, 512) and not ops.tc_topk_by_default(4096, 131072, 512)
    for rows_, n, k in ((64, 1 << 20, 2048), (64, 600000, 2048), (4096, 8192, 64), (4096, 8192, 4096),
                        (4096, 4096, 512), (64, (1 << 18) + 1, 2048)):
        assert not ops.tc_topk_by_default(rows_, n, k), (rows_, n, k)          # outside the measured range
    for rows_ in (64, 256, 4096, 65535):
        for n in (8192, 32768, 131072, 262144):
            for k in (512, 1024, 2048):
                if ops.tc_topk_by_default(rows_, n, k):
                    assert workspace.dense_topk_takes(rows_, n, k) or (rows_ >= workspace.DENSE_MANY_ROWS and n <= 8192)


TRITON_TOPK = r"kpool_topk_(sample|collect|dense_select|rows)"
PALLAS_TOPK = r"kpool_topk(?!_(sample|collect|dense_select|rows))"


@pytest.mark.gpu
def test_tc_topk_default_follows_the_rule(rng):
    """topk_pools(implementation=None) traces the Triton top-k exactly where
    tc_topk_by_default says so (the sampled form, or one program per row for many short
    rows), the Pallas kernels elsewhere and whenever splits is given, and returns the
    reference's ids either way."""
    _require_triton()
    for rows, n, k, want in ((64, 8192, 2048, "kpool_topk_sample"), (16, 8192, 2048, None),
                             (64, 8192, 512, None), (300, 8192, 512, "kpool_topk_rows"),
                             (300, 40000, 512, None), (300, 40000, 2048, "kpool_topk_sample")):
        x = jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32))
        lengths = jnp.asarray(rng.integers(0, n + 1, rows).astype(np.int32))
        assert ops.tc_topk_by_default(rows, n, k) == (want is not None)
        text = str(jax.make_jaxpr(lambda a, l: ops.topk_pools(a, l, k))(x, lengths))
        tc = bool(re.search(TRITON_TOPK, text))
        assert tc == (want is not None) and (want is None or want in text), (rows, n, k)
        assert bool(re.search(PALLAS_TOPK, text)) == (not tc), (rows, n, k)
        if want:
            text = str(jax.make_jaxpr(lambda a, l: ops.topk_pools(a, l, k, splits=2))(x, lengths))
            assert re.search(PALLAS_TOPK, text) and not re.search(TRITON_TOPK, text)
        got = np.asarray(jax.jit(lambda a, l: ops.topk_pools(a, l, k))(x, lengths))
        np.testing.assert_array_equal(got, np_topk(np.asarray(x), np.asarray(lengths), k))


def test_select_tokens_argument_errors(rng):
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, n=4)
    pos = jnp.asarray(np.arange(4)[None, :], jnp.int32)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="workspace_bytes must be a positive int"):
            ops.select_tokens(cache, layout, layer, q8, wf, jnp.asarray(table), pos, workspace_bytes=bad)


def test_xla_selection_is_the_same_under_any_workspace(rng):
    """The workspace bound only chunks the query rows: a bound of a few rows gives the
    same token indices as the default."""
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, n=40, max_pages=12)
    pos = jnp.asarray(rng.permutation(np.arange(500, 500 + 40))[None, :], jnp.int32)
    f = jax.jit(lambda c, q, w, t, p, ws: ops.select_tokens(c, layout, layer, q, w, t, p, topk_tokens=64,
                                                            short_context=False, implementation="xla",
                                                            workspace_bytes=ws), static_argnums=5)
    hp = q8.shape[2]
    row = hp * 12 * s.page_rows * 4
    want = np.asarray(f(cache, q8, wf, jnp.asarray(table), pos, None))
    for ws in (row, 3 * row + 1, 17 * row):
        np.testing.assert_array_equal(np.asarray(f(cache, q8, wf, jnp.asarray(table), pos, ws)), want)


def test_the_bound_holds_for_the_reference(rng):
    """The XLA reference is one of the contract's two computations: within E of the exact
    logits on random cases (and the bound is not vacuous: E is far below the logits)."""
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, n=24)
    want = np.asarray(jax.jit(ref.paged_logits_strides, static_argnums=1)(
        cache, s, q8, wf, jnp.asarray(table), jnp.asarray(ctx)))
    gold, e = golden(cache, layout, layer, q8, wf, table, ctx)
    fin = np.isfinite(gold)
    assert np.array_equal(np.isneginf(want), ~fin)
    assert (np.abs(want[fin] - gold[fin]) <= e[fin]).all()
    assert np.median(e[fin] / np.maximum(np.abs(gold[fin]), 1e-30)) < 1e-3


# ---------------------------------------------------------------------------------
# GPU: the kernels compiled
# ---------------------------------------------------------------------------------
def _require_triton():
    reason = _call.unavailable_reason()
    if reason is not None:
        pytest.fail(f"the Triton kernels cannot run on this GPU machine: {reason}")


TC_CASES = [
    pytest.param(dict(block_size=1152, heads=32), id="P32-H32"),
    pytest.param(dict(block_size=256, heads=32), id="P64-H32"),
    pytest.param(dict(block_size=512, heads=64), id="P64-H64"),
    pytest.param(dict(block_size=128, heads=16), id="P32-H16pad32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", TC_CASES)
def test_tc_paged_logits_within_the_bound(rng, case):
    _require_triton()
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, b=2, n=37, **case)
    got = np.asarray(ops.paged_logits(cache, layout, layer, q8, wf, jnp.asarray(table), jnp.asarray(ctx),
                                      implementation="triton"))
    q8p, wp = ops.pad_heads(q8), jnp.pad(wf, ((0, 0), (0, 0), (0, ops.padded_heads(q8.shape[2]) - q8.shape[2])))
    gold, e = golden(cache, layout, layer, q8p, wp, table, ctx)
    assert got.shape == gold.shape
    assert not np.isnan(got).any()                               # every element written
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(gold))
    fin = np.isfinite(gold)
    assert (np.abs(got[fin] - gold[fin]) <= e[fin]).all(), np.max(np.abs(got[fin] - gold[fin]) / e[fin])


def adversarial_scores(rng, rows, n):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0] = np.maximum(x[0], 0.0)                                 # a ReLU plateau of exact zeros
    x[0, rng.integers(0, n, 3)] = 0.0
    x[1] = np.round(x[1] * 2) / 2                                # few distinct values: heavy ties
    x[2, ::7] = np.nan
    x[2, 1::11] = -0.0
    x[2, 3] = np.inf
    x[2, 5] = -np.inf
    x[3] *= 1e30                                                 # huge
    x[4] *= 1e-30                                                # tiny (subnormal-ish)
    x[5] = 1.0 + rng.random(n).astype(np.float32) * 1e-5         # distinct keys in a narrow bin ...
    x[5, 0], x[5, 1] = 3e38, -3e38                               # ... of a huge range (exact fallback)
    x[6] = 7.0                                                   # all equal
    x[7] = np.repeat(rng.standard_normal(-(-n // 8)), 8)[:n]     # duplicated keys
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [24, 300])
@pytest.mark.parametrize("k", [512, 2048])
def test_tc_topk_equals_the_reference(rng, k, rows):
    """topk_pools(implementation="triton"): 24 rows through the split form with maxima of
    their own, 300 rows one program each."""
    _require_triton()
    n = 9000
    x = adversarial_scores(rng, rows, n)
    lengths = rng.integers(0, n + 100, rows).astype(np.int32)
    lengths[:8] = n
    lengths[8], lengths[9], lengths[10] = 0, k - 1, k + 1        # empty, shorter than k, just above
    f = jax.jit(lambda a, l: ops.topk_pools(a, l, k, implementation="triton"))
    got = np.asarray(f(jnp.asarray(x), jnp.asarray(lengths)))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(lambda a, l: ref.topk_pools(a, l, k))(
        jnp.asarray(x), jnp.asarray(lengths))))
    np.testing.assert_array_equal(got, np_topk(x, lengths, k))
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x), jnp.asarray(lengths))), got)   # run to run


def group_maxima(x):
    """[rows, n] scores -> [rows, workspace.maxima_cols(n)] u32: the largest order key of the
    columns of each group (workspace.group_columns), what the logits kernel writes."""
    rows, n = x.shape
    groups = workspace.maxima_cols(n)
    cols = np.array([workspace.group_columns(g) for g in range(groups)])
    keys = np.zeros((rows, cols.max() + 1), np.uint32)
    keys[:, :n] = np.asarray(ref.order_key(jnp.asarray(x)))
    return keys[:, cols].max(axis=2)


def group_of(col):
    s, r = divmod(int(col), workspace.MAXIMA_STEP_POOLS)
    return s * 8 + (r // 16) * 2 + (r % 8) // 4


def _tc_topk_with_maxima(x, lengths, k, mx, floor_maxima=None):
    """The row top-k with maxima and no register form: every row of >= k whole groups
    through the maxima's floor (from at most floor_maxima maxima in registers, the
    others by histograms; None: the default)."""
    from pallas_kernels.triton_lang import topk_rows
    tune = topk_rows.Tuning(reg_pools=0)
    if floor_maxima is not None:
        tune = dataclasses.replace(tune, floor_maxima=floor_maxima)
    return np.asarray(jax.jit(lambda a, l, m: topk_rows.topk_pools(a, l, k, m, tune=tune))(
        jnp.asarray(x), jnp.asarray(lengths), jnp.asarray(mx)))


@pytest.mark.gpu
def test_tc_topk_tuning_refuses_shapes_it_cannot_run():
    """A row top-k shape off the kernel's rules is refused when made: BLOCK a power of two
    of at most 2**14 (a step's two counts share a signed 32-bit word, the second shifted
    by 16 bits: 2**15 entries on the edge would reach the sign bit), warps a power of two
    to 16."""
    _require_triton()
    from pallas_kernels.triton_lang import topk_rows
    assert topk_rows.Tuning(block=1 << 14).block == 1 << 14
    for bad in (dict(block=1 << 15), dict(block=1 << 16), dict(block=48), dict(num_warps=3), dict(bins=8),
                dict(reg_pools=100)):
        with pytest.raises(ValueError, match="bad triton top-k tuning"):
            topk_rows.Tuning(**bad)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 512, 2048])
@pytest.mark.parametrize("floor_maxima", [None, 0, 64])
def test_tc_topk_with_maxima_equals_the_reference(rng, k, floor_maxima):
    """The top-k through the maxima's floor (rows of >= k whole groups) and its fallbacks
    (plateaus tied at the floor, short rows) give the reference's ids bit for bit; scores
    past a row's length (here larger than any inside) never count. The floor comes from
    the maxima in registers (default), from histograms (0), or both (64: at k = 64 the
    rows of exactly 64 whole groups take the registers, the longer ones histograms)."""
    _require_triton()
    g = workspace.MAXIMA_GROUP_POOLS
    rows, n = 28, g * k * 2 + 13
    x = adversarial_scores(rng, rows, n)
    x[8] = np.sort(x[8])                                         # increasing: too many candidates, whole row
    x[9] = np.repeat(rng.standard_normal(-(-n // g)), g)[:n]     # whole groups tied
    x[10] = np.where(rng.random(n) < 0.02, rng.standard_normal(n), 0.0).astype(np.float32)   # sparse + zeros
    lengths = rng.integers(0, n + 100, rows).astype(np.int32)
    lengths[:11] = n
    lengths[11], lengths[12], lengths[13] = g * k - 1, g * k, g * k + 3      # around the path's threshold
    lengths[14], lengths[15] = k - 1, 0
    lengths[16] = n - 40
    x[16, n - 40:] = 1e38                                        # larger than all, past the length
    lengths[17] = n - 3
    kp = workspace.padded_k(k)                                   # the k-th best tied with > KP candidates,
    x[18] = rng.uniform(0, 0.9, n).astype(np.float32)            # which are in group order, not id order
    x[18, 102:102 + 2 * kp + 40] = 1.0
    x[18, n - 50] = 1.5
    lengths[18] = n
    mx = group_maxima(x)
    got = _tc_topk_with_maxima(x, lengths, k, mx, floor_maxima)
    np.testing.assert_array_equal(got, np_topk(x, lengths, k))
    np.testing.assert_array_equal(_tc_topk_with_maxima(x, lengths, k, mx, floor_maxima), got)   # run to run


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 512])
@pytest.mark.parametrize("reg_pools", [0, 4096])
def test_tc_topk_by_pool_is_the_reference_by_pool_id(rng, k, reg_pools):
    """order="pool": the row top-k's ids (through the maxima's floor and the whole-row
    walk, with reg_pools the register form, and rows of at most k scores, which take no
    walk) are the reference's by ascending id with -1 after them, bit for bit; an
    unknown order is refused."""
    _require_triton()
    from pallas_kernels.triton_lang import topk_rows
    g = workspace.MAXIMA_GROUP_POOLS
    rows, n = 24, g * k * 2 + 13
    x = adversarial_scores(rng, rows, n)
    lengths = rng.integers(0, n + 100, rows).astype(np.int32)
    lengths[:4] = n
    lengths[4:10] = [0, 1, k - 1, k, k + 1, g * k - 1]
    want = np.asarray(ref.pool_order(jnp.asarray(np_topk(x, lengths, k))))
    tune = topk_rows.Tuning(reg_pools=reg_pools)
    f = jax.jit(lambda a, ln, m: topk_rows.topk_pools(a, ln, k, m, tune=tune, order="pool"))
    got = np.asarray(f(jnp.asarray(x), jnp.asarray(lengths), jnp.asarray(group_maxima(x))))
    np.testing.assert_array_equal(got, want)
    assert (got[:4] != np_topk(x, lengths, k)[:4]).any()          # not already the score order
    with pytest.raises(ValueError, match="order must be"):
        topk_rows.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k, order="id")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 512, 2048])
@pytest.mark.parametrize("reg_pools, warps", [(4096, 4), (8192, 8), (2048, 4)])
def test_tc_topk_in_registers_equals_the_reference(rng, k, reg_pools, warps):
    """Rows of at most reg_pools scores, held in registers (adversarial keys: ties at the
    k-th best, plateaus of zeros, NaN, +-inf, huge and tiny, every key equal), and the
    longer rows, in a second launch merged by row length (through the maxima's floor,
    or over the whole row where it has fewer than k whole groups or comes without
    maxima), give the reference's ids bit for bit, run to run; scores past a row's
    length never count."""
    _require_triton()
    from pallas_kernels.triton_lang import topk_rows
    rows, n = 30, reg_pools + 3 * 1024
    x = adversarial_scores(rng, rows, n)
    x[8] = np.sort(x[8])                                         # increasing: the best at the end
    x[9] = np.where(rng.random(n) < 0.02, rng.standard_normal(n), 0.0).astype(np.float32)   # sparse + zeros
    x[10] = np.round(x[10] * 64) / 64                            # ties across the k-th best
    lengths = rng.integers(0, reg_pools + 1, rows).astype(np.int32)
    lengths[:11] = reg_pools                                     # the longest the registers hold
    lengths[11], lengths[12], lengths[13], lengths[14] = 0, k - 1, k, k + 1
    lengths[15], lengths[16], lengths[17] = reg_pools + 1, n, n + 100     # the second launch's rows
    lengths[18] = reg_pools - 40
    x[18, reg_pools - 40:] = 1e38                                # larger than all, past the length
    lengths[19] = 1
    lengths[20] = -5                                             # counts as 0, in the register launch
    want = np_topk(x, np.maximum(lengths, 0), k)
    tune = topk_rows.Tuning(reg_pools=reg_pools, num_warps=warps)
    mx = jnp.asarray(group_maxima(x))
    f = jax.jit(lambda a, l, m: topk_rows.topk_pools(a, l, k, m, tune=tune))
    got = np.asarray(f(jnp.asarray(x), jnp.asarray(lengths), mx))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x), jnp.asarray(lengths), mx)), got)   # run to run
    g = jax.jit(lambda a, l: topk_rows.topk_pools(a, l, k, tune=tune))                # without maxima
    np.testing.assert_array_equal(np.asarray(g(jnp.asarray(x), jnp.asarray(lengths))), want)


@pytest.mark.gpu
@pytest.mark.parametrize("reg_pools", [4096, 8192])
def test_tc_topk_in_a_loop_equals_the_same_call_alone(rng, reg_pools):
    """Inside lax.map over chunks of a 32k prefill's shape (11,070 rows of 8,352 scores:
    the loop select_tokens runs its chunks in, each chunk's result written into the
    loop's stacked output), the row top-k gives the ids it gives called alone, with both
    launches: the register form for the rows it holds (without maxima) and the walks
    through the maxima's floor for the rest."""
    _require_triton()
    from pallas_kernels.triton_lang import topk_rows
    k, rows, n = 512, 11070, 8352
    x = jnp.asarray(rng.standard_normal((2, rows, n)).astype(np.float32))
    lengths = jnp.asarray(rng.integers(0, n + 1, (2, rows)).astype(np.int32))
    mx = jnp.stack([jnp.asarray(group_maxima(np.asarray(x[i]))) for i in range(2)])
    tune = topk_rows.Tuning(reg_pools=reg_pools)
    call = lambda a, l, m: topk_rows.topk_pools(a, l, k, m, tune=tune)  # noqa: E731
    alone = np.stack([np.asarray(jax.jit(call)(x[i], lengths[i], mx[i])) for i in range(2)])
    looped = np.asarray(jax.jit(lambda a, l, m: jax.lax.map(lambda c: call(*c), (a, l, m)))(x, lengths, mx))
    np.testing.assert_array_equal(looped, alone)
    ln = np.asarray(lengths[0])
    shortest_full = int(np.argmin(np.where(ln > k, ln, n + 1)))     # a register row of more than k scores
    for i in (shortest_full, int(np.argmax(np.where(ln <= reg_pools, ln, -1))), int(np.argmax(ln))):
        np.testing.assert_array_equal(alone[0, i], np_topk(np.asarray(x[0, i:i + 1]), ln[i:i + 1], k)[0])


def step_maxima(x):
    """[rows, n] scores -> [rows, maxima_cols(n, 64)] u32: the largest order key of each
    64-column step."""
    rows, n = x.shape
    steps = workspace.maxima_cols(n, workspace.MAXIMA_STEP_POOLS)
    keys = np.zeros((rows, steps * 64), np.uint32)
    keys[:, :n] = np.asarray(ref.order_key(jnp.asarray(x)))
    return keys.reshape(rows, steps, 64).max(axis=2)


def _dense_launches(x, lengths, k):
    """topk_pools' few-rows form launch by launch: (guess, count after the sample, key,
    id, count after the collect, ids)."""
    from pallas_kernels.triton_lang import dense_topk

    def f(a, l):
        g, c0 = dense_topk.sample_guesses(a, l, k)
        cand = dense_topk.collect_candidates(a, l, g, c0, k)
        return (g, c0) + tuple(cand) + (dense_topk.select_candidates(a, l, cand, k),)
    return [np.asarray(v) for v in jax.jit(f)(jnp.asarray(x), jnp.asarray(lengths))]


def dense_rows(rng, rows, n, k):
    x = adversarial_scores(rng, rows, n)
    x[8] = np.sort(x[8])                                         # increasing: the best at the end
    x[9] = np.where(rng.random(n) < 0.02, rng.standard_normal(n), 0.0).astype(np.float32)   # sparse + zeros
    x[10] = -np.abs(x[10])                                       # every score at or below zero
    lengths = np.full(rows, n, np.int32)
    lengths[11], lengths[12], lengths[13], lengths[14] = 0, k - 1, k, k + 1
    lengths[15], lengths[16], lengths[17] = n + 100, -3, 20000
    x[17, 20000:] = 1e38                                         # larger than all, past the length
    return x, lengths


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(64, 131072 + 77), (512, 131072 + 77), (2048, 131072 + 77), (2048, 262144 + 77),
                                  (512, 16384)])
def test_tc_dense_topk_launches_follow_their_contracts(rng, k, n):
    """Launch by launch, over adversarial rows (plateaus, ties, NaN, +-inf, sorted,
    sparse, rows shorter than k, empty, past their length): the sample writes the
    numpy guess and zero counters; the collect finds exactly the scores below the
    length that reach the guess, each once, with their keys; the select gives the
    reference's ids, from the candidates or (overflow, too few) the whole row. Samples
    of 16,384, 4,096, 8,192 and 2,048 scores (``workspace.sample_pools``)."""
    _require_triton()
    rows = 20
    x, lengths = dense_rows(rng, rows, n, k)
    guess, count0, key, ids, count, out = _dense_launches(x, lengths, k)
    width = workspace.dense_candidates(k)
    np.testing.assert_array_equal(guess, [sample_guess(x[r], lengths[r], k) for r in range(rows)])
    np.testing.assert_array_equal(count0, np.zeros(rows))
    keys = np.asarray(ref.order_key(jnp.asarray(x)))
    for r in range(rows):
        m = int(np.clip(lengths[r], 0, n))
        want = np.flatnonzero(keys[r, :m] >= guess[r])
        assert count[r] == want.size
        if want.size <= width:
            got = ids[r, :want.size]
            np.testing.assert_array_equal(np.sort(got), want)
            np.testing.assert_array_equal(key[r, :want.size], keys[r, got])
    took = (count >= np.minimum(np.clip(lengths, 0, n), k)) & (count <= width)
    assert took.sum() >= 8 and (~took).sum() >= 1, "both the candidates' and the whole-row path"
    np.testing.assert_array_equal(out, np_topk(x, np.clip(lengths, 0, None), k))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 2048])
def test_tc_topk_of_few_long_rows_equals_the_reference(rng, k):
    """ops.topk_pools(implementation="triton") of 20 rows (three launches: sample,
    collect, select) gives the reference's ids bit for bit, run to run."""
    _require_triton()
    x, lengths = dense_rows(rng, 20, 131072, k)
    f = jax.jit(lambda a, l: ops.topk_pools(a, l, k, implementation="triton"))
    args = (jnp.asarray(x), jnp.asarray(lengths))
    assert f.lower(*args).compile().as_text().count(f'custom_call_target="{_call.FFI_TARGET}"') == 3
    got = np.asarray(f(*args))
    np.testing.assert_array_equal(got, np_topk(x, np.clip(lengths, 0, None), k))
    for _ in range(2):                                           # the atomics' order never shows
        np.testing.assert_array_equal(np.asarray(f(*args)), got)


def _split_topk(x, lengths, k, mx, pools):
    from pallas_kernels.triton_lang import split_topk
    return np.asarray(jax.jit(lambda a, l, m: split_topk.topk_pools_split(a, l, k, m, pools))(
        jnp.asarray(x), jnp.asarray(lengths), jnp.asarray(mx)))


@pytest.mark.gpu
@pytest.mark.parametrize("pools", [8, 64])
@pytest.mark.parametrize("k", [64, 512, 2048])
def test_tc_split_topk_equals_the_reference(rng, k, pools):
    """The split top-k (candidates from many programs per row, appended in whatever order
    their atomics land, then ranked by several programs per row) gives the reference's ids bit for bit,
    run to run: through the floor, with floor 0 (fewer than k whole-step maxima), and
    through the whole-row walk when the candidates overflow."""
    _require_triton()
    rows = 24
    n = max(pools * k * 2 + 13, 3 * 64 * k // 8 + 29)
    x = adversarial_scores(rng, rows, n)
    x[8] = np.sort(x[8])                                         # increasing: clustered at the end
    x[9] = np.repeat(rng.standard_normal(-(-n // pools)), pools)[:n]     # whole groups tied
    x[10] = np.where(rng.random(n) < 0.02, rng.standard_normal(n), 0.0).astype(np.float32)   # sparse + zeros
    lengths = rng.integers(0, n + 100, rows).astype(np.int32)
    lengths[:11] = n
    lengths[11], lengths[12], lengths[13] = 64 * k // (64 // pools) - 1, 64 * k // (64 // pools), min(64 * k + 5, n - 7)
    lengths[14], lengths[15] = k - 1, 0
    lengths[16] = n - 40
    x[16, n - 40:] = 1e38                                        # larger than all, past the length
    mx = group_maxima(x) if pools == 8 else step_maxima(x)
    got = _split_topk(x, lengths, k, mx, pools)
    np.testing.assert_array_equal(got, np_topk(x, lengths, k))
    for _ in range(3):                                           # the atomics' order never shows
        np.testing.assert_array_equal(_split_topk(x, lengths, k, mx, pools), got)


@pytest.mark.gpu
@pytest.mark.parametrize("k, rows", [(64, 12), (512, 12), (64, 300)])
def test_tc_split_tokens_are_the_expanded_ids(rng, k, rows):
    """The rank launch's token columns equal expand_pools of the split top-k's ids, the
    tail columns included, for rows of every length (padding, 0, tail only, shorter than
    k, ranked) and for rows that cannot be ranked: a plateau at the floor (more
    candidates than the buffer, with a tail) and maxima above every score (none). 300
    rows: one rank program per row."""
    _require_triton()
    from pallas_kernels.triton_lang import split_topk
    r = 4
    n = 8 * k * 3 + 50
    x = adversarial_scores(rng, rows, n)
    x[3] = 0.0                                                   # a plateau: more candidates than the buffer
    seq = rng.integers(0, n * r + 4, rows).astype(np.int32)
    seq[:6] = [0, 3, (k - 1) * r + 2, n * r - 1, n * r, -1]      # empty, tail only, < k pools, .., padding
    mx = group_maxima(x)
    mx[4] = 0xFFFFFFFF                                           # a floor no score reaches: no candidates
    lengths = seq // r
    pos = seq - 1                                                # -2 pads like -1
    args = (jnp.asarray(x), jnp.asarray(pos), jnp.asarray(mx))
    got = np.asarray(jax.jit(lambda a, p, m: split_topk.select_tokens_split(a, p, k, m, 8, r))(*args))
    ids = np_topk(x, np.maximum(lengths, 0), k)
    np.testing.assert_array_equal(got, np_expand(ids, seq, r))
    np.testing.assert_array_equal(_split_topk(x, lengths, k, mx, 8), ids)
    cnt = np.asarray(jax.jit(lambda a, l, m: split_topk.split_candidates(a, l, k, m, 8))(
        jnp.asarray(x), jnp.asarray(lengths), jnp.asarray(mx))[2])
    assert cnt[3] > workspace.candidate_cap(k) and cnt[4] == 0    # both rows took the whole-row walk
    if rows > workspace.SPLIT_PROGRAMS:                          # the case runs one rank program per row
        from pallas_kernels.triton_lang import topk_rank
        assert workspace.rank_programs(rows, workspace.candidate_cap(k), topk_rank.TI) == 1


def floor16(keys, take):
    """The split top-k's floor: the top 16 bits of the take-th largest key, the rest 0."""
    kth = np.sort(keys.astype(np.uint64))[::-1][take - 1]
    return int(kth) & 0xFFFF0000


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, 64])
@pytest.mark.parametrize("pools", [8, 64])
def test_tc_split_candidates_are_the_scores_above_the_floor(rng, monkeypatch, pools, tile):
    """The candidate launch appends exactly the scores below a row's length whose order key
    reaches the floor of the row's whole-step maxima (floor 0 below k of them), each once;
    and the selection is exact whatever the maxima hold (overstated: too few candidates,
    the whole-row walk; garbage: any floor). tile=64: the floor counts over maxima read
    tile by tile (rows with more maxima than FLOOR_MAXIMA) instead of held in registers."""
    _require_triton()
    from pallas_kernels.triton_lang import split_topk
    if tile is not None:
        monkeypatch.setattr(workspace, "FLOOR_MAXIMA", tile)
    k, rows = 64, 7
    n = 64 * k * 3 + 50
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1] = np.round(x[1] * 4) / 4                                # ties across the floor
    x[6] = 0.0                                                   # a plateau: every score reaches the floor
    lengths = np.array([n, n - 77, 64 * k // (64 // pools) - 1, 64 * k + 64, 100, 0, n], np.int32)
    mx = group_maxima(x) if pools == 8 else step_maxima(x)
    sk, si, cnt = (np.asarray(a) for a in jax.jit(lambda a, l, m: split_topk.split_candidates(a, l, k, m, pools))(
        jnp.asarray(x), jnp.asarray(lengths), jnp.asarray(mx)))                 # traced now: FLOOR_MAXIMA as set
    keys = np.asarray(ref.order_key(jnp.asarray(x)))
    base, cap = 2 * workspace.padded_k(k), workspace.candidate_cap(k)
    for r in range(rows):
        ng = lengths[r] // 64 * (64 // pools)
        f = floor16(mx[r, :ng], k) if ng >= k else 0
        ids = np.nonzero(keys[r, :lengths[r]] >= f)[0]
        assert cnt[r] == ids.size, (r, cnt[r], ids.size)
        got = si[r, base:base + min(cnt[r], cap)]                # a count past CAP keeps CAP of them
        assert np.unique(got).size == got.size and np.isin(got, ids).all()
        if cnt[r] <= cap:
            np.testing.assert_array_equal(np.sort(got), ids)
        np.testing.assert_array_equal(sk[r, base:base + got.size], keys[r, got])
    assert ((cnt > k) & (cnt < n // 4)).any()                    # the floor cut most of a row
    assert (cnt > cap).any()                                     # and a row overflowed the buffer
    want = np_topk(x, lengths, k)
    if tile is None:
        for bad in (np.full_like(mx, 0xFFFFFFFF),
                    rng.integers(0, 2**32, mx.shape, dtype=np.uint64).astype(np.uint32)):
            np.testing.assert_array_equal(_split_topk(x, lengths, k, bad, pools), want)


@pytest.mark.gpu
@pytest.mark.parametrize("floor_maxima", [None, 0])
def test_tc_topk_reads_only_the_groups_above_the_floor(rng, floor_maxima):
    """The maxima decide which scores are read: with the best group's maximum understated
    the best score is never seen (so the test above runs the floor path, not the fallback),
    whether the floor comes from the maxima in registers or from histograms."""
    _require_triton()
    k, rows = 64, 6
    n = workspace.MAXIMA_GROUP_POOLS * k * 3
    x = rng.standard_normal((rows, n)).astype(np.float32)
    lengths = np.full(rows, n, np.int32)
    mx = group_maxima(x)
    best = np.argmax(x, axis=1)
    assert (_tc_topk_with_maxima(x, lengths, k, mx, floor_maxima)[:, 0] == best).all()
    mx[np.arange(rows), [group_of(b) for b in best]] = 1
    got = _tc_topk_with_maxima(x, lengths, k, mx, floor_maxima)
    assert all(best[r] not in got[r] for r in range(rows))


def nan_and_inf_weights(rng, wf, ctx):
    """(wf [B, n, Hp] with one live head weight set to +inf in the row of the longest
    context, one to -inf in the next and one to NaN in the third, [those three (b, i)])
    for ctx [B, n] (pools seen): the first row's logits are +inf or NaN (0 * inf where
    that head's ReLU is 0), the second's -inf or NaN, the third's all NaN
    (``check_odd_rows``)."""
    w = np.array(wf)
    rows = [divmod(int(r), w.shape[1]) for r in np.argsort(-np.asarray(ctx).reshape(-1), kind="stable")[:3]]
    for v, (b, i) in zip((np.inf, -np.inf, np.nan), rows):
        w[b, i, rng.choice(np.flatnonzero(w[b, i] != 0))] = v
    return jnp.asarray(w), rows


def check_odd_rows(logits, ctx, rows):
    """The logits below each context of ``nan_and_inf_weights``' rows are what it says;
    the first two rows, if they see 32 pools or more, hold an infinity (each pool's head
    ReLU is 0 with probability about 1/2)."""
    for (b, i), inf in zip(rows, (np.inf, -np.inf, None)):
        x = logits[b, i, :int(ctx[b, i])]
        if inf is None:
            assert np.isnan(x).all()
        else:
            assert (np.isnan(x) | (x == inf)).all()
            assert x.size < 32 or (x == inf).any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", TC_CASES[:3])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("odd_weights", [False, True], ids=["finite", "nan-inf"])
def test_tc_logits_step_maxima_are_the_step_maxima(rng, case, n, odd_weights):
    """paged_logits(maxima=True, maxima_pools=64) for decode rows (a request's n rows per
    program): entry s is the largest order key of columns 64 s .. 64 s + 63 of the row's
    logits (-inf past its context, NaN the lowest) wherever the logits are written, and
    the logits are those of the call without maxima, with finite weights and with
    ``nan_and_inf_weights``."""
    _require_triton()
    from pallas_kernels.triton_lang import prefill_logits
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, b=3, n=n, max_pages=40, **case)
    if odd_weights:
        wf, odd = nan_and_inf_weights(rng, wf, ctx)
    args = (cache, s, q8, wf, jnp.asarray(table), jnp.asarray(ctx))
    plain = np.asarray(jax.jit(prefill_logits.paged_logits, static_argnums=1)(*args))
    if odd_weights:
        check_odd_rows(plain, ctx, odd)
    for fill in (True, False):
        lg, mx = jax.jit(lambda *a, fill=fill: prefill_logits.paged_logits(*a, fill=fill, maxima=True,
                                                                             maxima_pools=64),
                         static_argnums=1)(*args)
        lg, mx = np.asarray(lg), np.asarray(mx)
        seen_cols = np.arange(lg.shape[-1])[None, None, :] < ctx[..., None]           # written without fill
        want = step_maxima(np.where(seen_cols, lg, -np.inf).reshape(-1, lg.shape[-1])).reshape(mx.shape)
        for b in range(mx.shape[0]):
            for i in range(mx.shape[1]):
                c = int(ctx[b, i])
                seen = slice(None) if fill else slice(0, -(-c // 64))
                np.testing.assert_array_equal(mx[b, i, seen], want[b, i, seen])
                np.testing.assert_array_equal(lg[b, i, :c], plain[b, i, :c])


@pytest.mark.gpu
@pytest.mark.parametrize("case", TC_CASES[:3])
@pytest.mark.parametrize("n", [1, 3])
def test_tc_decode_logits_read_positions_and_zero_the_counters(rng, case, n):
    """The decode form of paged_logits: positions in place of contexts (row p sees
    (p + 1) // kpool pools, -1 pads) give the logits and maxima of the contexts they
    mean, and ``counters`` comes back zero in every row (written where a block of -1 was
    freed just before, which XLA's allocator usually hands out again; a kernel that did
    not write would show it), and counts the candidates of split_candidates from zero."""
    _require_triton()
    from pallas_kernels.triton_lang import prefill_logits, split_topk
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, b=3, n=n, max_pages=40, **case)
    r = layout.config.kpool
    pos = (ctx * r + rng.integers(0, r, ctx.shape) - 1).astype(np.int32)
    pos[ctx == 0] = rng.choice([-1, -5, r - 2], (ctx == 0).sum())    # padding, and a tail with no pool
    ctx = np.maximum(pos + 1, 0) // r
    pools = 64
    lg, mx = jax.jit(lambda *a: prefill_logits.paged_logits(*a, fill=False, maxima=True, maxima_pools=pools,
                                                            tune=prefill_logits.DECODE),
                     static_argnums=1)(cache, s, q8, wf, jnp.asarray(table), jnp.asarray(ctx))
    junk = jnp.full((64 << 20,), -1, jnp.int32).block_until_ready()    # freed: the next outputs may land on it
    del junk
    lg_p, mx_p, zeros = jax.jit(lambda *a: prefill_logits.paged_logits(
        *a, fill=False, maxima=True, maxima_pools=pools, tune=prefill_logits.DECODE, positions_kpool=r,
        counters=True), static_argnums=1)(cache, s, q8, wf, jnp.asarray(table), jnp.asarray(pos))
    lg, mx, lg_p, mx_p, zeros = (np.asarray(a) for a in (lg, mx, lg_p, mx_p, zeros))
    assert zeros.shape == ctx.shape and (zeros == 0).all()
    for b in range(ctx.shape[0]):
        for i in range(n):
            c = int(ctx[b, i])
            np.testing.assert_array_equal(lg_p[b, i, :c], lg[b, i, :c])
            np.testing.assert_array_equal(mx_p[b, i, :-(-c // 64)], mx[b, i, :-(-c // 64)])
    k = 16
    rows = ctx.size
    cnt = np.asarray(jax.jit(lambda x, p, m, z: split_topk.split_candidates(x, p, k, m, pools, kpool=r, counters=z))(
        jnp.asarray(lg_p.reshape(rows, -1)), jnp.asarray(pos.reshape(-1)), jnp.asarray(mx_p.reshape(rows, -1)),
        jnp.asarray(zeros.reshape(-1)))[2])
    want = np.asarray(jax.jit(lambda x, l, m: split_topk.split_candidates(x, l, k, m, pools))(
        jnp.asarray(lg.reshape(rows, -1)), jnp.asarray(ctx.reshape(-1)), jnp.asarray(mx.reshape(rows, -1)))[2])
    np.testing.assert_array_equal(cnt, want)
    assert (want > 0).any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", TC_CASES[:3])
@pytest.mark.parametrize("odd_weights", [False, True], ids=["finite", "nan-inf"])
def test_tc_logits_maxima_are_the_group_maxima(rng, case, odd_weights):
    """paged_logits(maxima=True): entry g is the largest order key of the logits in
    workspace.group_columns(g) (NaN the lowest), everywhere with fill and where the
    logits are written without it; the logits are the same as without maxima, with
    finite weights and with ``nan_and_inf_weights``."""
    _require_triton()
    from pallas_kernels.triton_lang import prefill_logits
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, b=2, n=37, **case)
    if odd_weights:
        wf, odd = nan_and_inf_weights(rng, wf, ctx)
    args = (cache, s, q8, wf, jnp.asarray(table), jnp.asarray(ctx))
    plain = np.asarray(jax.jit(prefill_logits.paged_logits, static_argnums=1)(*args))
    if odd_weights:
        check_odd_rows(plain, ctx, odd)
    last = np.array([max(workspace.group_columns(g)) for g in range(workspace.maxima_cols(plain.shape[-1]))])
    inside = last < plain.shape[-1]                              # groups past the columns are never written
    for fill in (True, False):
        lg, mx = jax.jit(lambda *a, fill=fill: prefill_logits.paged_logits(*a, fill=fill, maxima=True),
                         static_argnums=1)(*args)
        lg, mx = np.asarray(lg), np.asarray(mx)
        want = group_maxima(lg.reshape(-1, lg.shape[-1])).reshape(mx.shape)
        if fill:
            np.testing.assert_array_equal(lg, plain)
            np.testing.assert_array_equal(mx[..., inside], want[..., inside])
        else:                                                    # the groups below each row's context
            for b in range(mx.shape[0]):
                for i in range(mx.shape[1]):
                    seen = last < ctx[b, i]
                    np.testing.assert_array_equal(mx[b, i, seen], want[b, i, seen])
                    np.testing.assert_array_equal(lg[b, i, :ctx[b, i]], plain[b, i, :ctx[b, i]])


@pytest.mark.gpu
@pytest.mark.parametrize("case", TC_CASES[:2])
def test_tc_logits_of_a_window_of_rows_equal_those_rows(rng, case):
    """paged_logits(first_row=f) over the context of rows f .. f + c - 1 reads those rows
    of the whole queries and weights: the logits and maxima equal the whole call's rows,
    bit for bit, at windows from row 0, across a program's rows and ending at the last
    row, and a first row past the last window clamps to it; a window that does not fit,
    rows that differ without first_row, a float first_row and weights that do not follow
    q8 are refused."""
    _require_triton()
    from pallas_kernels.triton_lang import prefill_logits
    layout, layer, s, cache, q8, wf, table, ctx = tc_case(rng, b=2, n=45, **case)
    f = jax.jit(lambda c, q, w, t, x, first: prefill_logits.paged_logits(c, s, q, w, t, x, fill=False, maxima=True,
                                                                          first_row=first))
    whole_lg, whole_mx = (np.asarray(a) for a in jax.jit(
        lambda c, q, w, t, x: prefill_logits.paged_logits(c, s, q, w, t, x, fill=False, maxima=True))(
            cache, q8, wf, jnp.asarray(table), jnp.asarray(ctx)))
    last = np.array([max(workspace.group_columns(g)) for g in range(whole_mx.shape[-1])])
    for first, c, asked in ((0, 16, 0), (5, 11, 5), (45 - 13, 13, 45 - 13), (int(rng.integers(1, 30)), 15, None),
                            (45 - 13, 13, 45 - 13 + 7)):          # asked: the first_row given (past the end: clamped)
        asked = first if asked is None else asked
        lg, mx = (np.asarray(a) for a in f(cache, q8, wf, jnp.asarray(table), jnp.asarray(ctx[:, first:first + c]),
                                           jnp.int32(asked)))
        for b in range(2):
            for i in range(c):
                n_ctx = int(ctx[b, first + i])
                np.testing.assert_array_equal(lg[b, i, :n_ctx], whole_lg[b, first + i, :n_ctx])
                np.testing.assert_array_equal(mx[b, i, last < n_ctx], whole_mx[b, first + i, last < n_ctx])
    with pytest.raises(ValueError, match="does not fit"):
        prefill_logits.paged_logits(cache, s, q8[:, :4], wf[:, :4], jnp.asarray(table), jnp.asarray(ctx[:, :5]),
                                    first_row=jnp.int32(0))
    with pytest.raises(ValueError, match="give first_row"):
        prefill_logits.paged_logits(cache, s, q8, wf, jnp.asarray(table), jnp.asarray(ctx[:, :5]))
    with pytest.raises(ValueError, match="integer scalar"):
        prefill_logits.paged_logits(cache, s, q8, wf, jnp.asarray(table), jnp.asarray(ctx[:, :5]), first_row=1.0)
    with pytest.raises(ValueError, match="must follow q8"):
        prefill_logits.paged_logits(cache, s, q8, wf[:, :5], jnp.asarray(table), jnp.asarray(ctx[:, :5]),
                                    first_row=0)


def _select(layout, layer, impl, ws=None):
    return jax.jit(lambda c, q, w, t, p: ops.select_tokens(c, layout, layer, q, w, t, p, short_context=False,
                                                           implementation=impl, workspace_bytes=ws))


def in_pool_order(tokens, k_tokens):
    """The token rows of select_tokens(order="score") as order="pool" gives them: the pool
    columns [: k_tokens] in ascending order with the -1 columns after them, the tail as is
    (numpy; independent of ``reference.pool_order``)."""
    return np.concatenate([ascending_then_empty(tokens[:, :k_tokens]), tokens[:, k_tokens:]], axis=1)


@pytest.mark.gpu
@pytest.mark.parametrize("reg_pools", [None, 1024])
def test_tc_select_tokens_follows_the_contract(rng, monkeypatch, reg_pools):
    """Prefill of one request: the selected pools equal the golden selection on every
    decided row, the tail columns equal the reference's, determinism run to run; with
    the default shape every row goes through the logits kernel's maxima, with 1024 the
    rows of at most 1024 pools take the register form. order="pool" (the row top-k
    without its sort by score) gives the same tokens in pool order."""
    _require_triton()
    if reg_pools is not None:
        from pallas_kernels.triton_lang import topk_rows
        monkeypatch.setattr(topk_rows, "DEFAULT", topk_rows.Tuning(reg_pools=reg_pools))
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, n=300, max_pages=40)
    c = layout.config
    n_pools = table.shape[1] * s.page_rows
    pos = np.sort(rng.choice(np.arange(2100, n_pools * c.kpool), 300, replace=False)).astype(np.int32)[None, :]
    seq = pos + 1
    ctx = seq // c.kpool
    k = 64
    f = jax.jit(lambda cc, q, w, t, p: ops.select_tokens(cc, layout, layer, q, w, t, p, topk_tokens=k * c.kpool,
                                                          short_context=False, implementation="triton"))
    got = np.asarray(f(cache, q8, wf, jnp.asarray(table), jnp.asarray(pos)))
    again = np.asarray(f(cache, q8, wf, jnp.asarray(table), jnp.asarray(pos)))
    np.testing.assert_array_equal(got, again)
    by_pool = np.asarray(jax.jit(lambda cc, q, w, t, p: ops.select_tokens(
        cc, layout, layer, q, w, t, p, topk_tokens=k * c.kpool, short_context=False, implementation="triton",
        order="pool"))(cache, q8, wf, jnp.asarray(table), jnp.asarray(pos)))
    np.testing.assert_array_equal(by_pool, in_pool_order(got, k * c.kpool))
    assert (by_pool != got).any()
    gold, e = golden(cache, layout, layer, q8, wf, table, ctx)
    gold, e = gold[0], e[0]
    decided = decided_rows(gold, e, ctx[0], k)
    assert decided.size >= 0.25 * pos.shape[1]                   # the check is not vacuous
    want = np_expand(np_topk(gold, ctx[0], k), seq[0], c.kpool)
    sel = lambda x: np.sort(x[:, :k * c.kpool].reshape(x.shape[0], k, c.kpool)[..., 0], axis=1)   # noqa: E731
    np.testing.assert_array_equal(sel(got[decided]), sel(want[decided]))               # the selected sets
    np.testing.assert_array_equal(got[:, k * c.kpool:], want[:, k * c.kpool:])         # the tail tokens


@pytest.mark.gpu
@pytest.mark.parametrize("reg_pools", [None, 4096])
def test_tc_select_tokens_in_chunks_equals_the_row_topk_alone(rng, monkeypatch, reg_pools):
    """A 32k-token prefill through select_tokens in its default chunks (lax.map over
    three chunks of 11,070 rows): every row's pools are those the row top-k gives for
    that chunk's logits called alone without the register form, itself the host
    reference's on each chunk's last (longest) row and two random ones. With the
    default (no register form) and with the register form for rows of up to 4096
    pools (the walks for the rest: two launches merged by row)."""
    _require_triton()
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_read import queries, read_case
    from pallas_kernels.triton_lang import prefill_logits as tcl
    from pallas_kernels.triton_lang import topk_rows
    alone_tune = dataclasses.replace(topk_rows.DEFAULT, reg_pools=0)
    if reg_pools is not None:
        monkeypatch.setattr(topk_rows, "DEFAULT", topk_rows.Tuning(reg_pools=reg_pools))
    cfg = IndexerConfig()
    k, tokens = cfg.topk_pools, 32768
    layout, cache, table, key, heads = read_case(cfg, 1, tokens, seed=int(rng.integers(1 << 30)))
    s = layout.strides(0)
    q8, w = queries(key, 1, tokens, heads)
    rows = workspace.rows_per_chunk(tokens, addr.pools_in_pages(s, table.shape[1]), k)
    assert rows < tokens                                           # chunks, so lax.map runs
    logits = jax.jit(lambda c, q_, w_, cx: tcl.paged_logits(c, s, q_, w_, table, cx, fill=False, maxima=True,
                                                            tune=tcl.PREFILL))
    alone = []
    for lo in range(0, tokens, rows):
        hi = min(lo + rows, tokens)
        ctx = ((jnp.arange(lo, hi, dtype=jnp.int32) + 1) // cfg.kpool)[None, :]
        lg, mx = logits(cache, q8[:, lo:hi], w[:, lo:hi], ctx)
        lg, mx, lens = lg.reshape(hi - lo, -1), mx.reshape(hi - lo, -1), ctx.reshape(-1)
        ids = np.asarray(topk_rows.topk_pools(lg, lens, k, mx, tune=alone_tune))
        pick = np.append(rng.choice(hi - lo - 1, 2, replace=False), hi - lo - 1)
        np.testing.assert_array_equal(ids[pick], np_topk(np.asarray(lg[pick]), np.asarray(lens)[pick], k))
        alone.append(ids)
    alone = np.concatenate(alone)
    pos = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    got = np.asarray(jax.jit(lambda c, q, ww, t, p: ops.select_tokens(
        c, layout, 0, q, ww, t, p, short_context=False, implementation="triton"))(cache, q8, w, table, pos))
    pools = got.reshape(tokens, -1)[:, 0:k * cfg.kpool:cfg.kpool] // cfg.kpool       # -1 stays -1
    np.testing.assert_array_equal(pools, alone)


@pytest.mark.gpu
def test_tc_select_tokens_is_batch_invariant(rng):
    """The same request's rows give the same indices whatever the chunking (workspace
    bound), the other requests of the batch and the rows around them."""
    _require_triton()
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, b=2, n=200, max_pages=40)
    c = layout.config
    n_pools = table.shape[1] * s.page_rows
    pos = np.stack([np.sort(rng.choice(np.arange(2000, n_pools * c.kpool), 200, replace=False))
                    for _ in range(2)]).astype(np.int32)
    args = (cache, q8, wf, jnp.asarray(table), jnp.asarray(pos))
    both = np.asarray(_select(layout, layer, "triton")(*args))
    row = workspace.chunk_row_bytes(n_pools, c.topk_pools)
    small = np.asarray(_select(layout, layer, "triton", ws=2 * 7 * row)(*args))       # chunks of 7 rows
    np.testing.assert_array_equal(small, both)
    alone = np.asarray(_select(layout, layer, "triton")(cache, q8[:1], wf[:1], jnp.asarray(table[:1]),
                                                        jnp.asarray(pos[:1])))
    np.testing.assert_array_equal(alone, both[:200])
    shifted = np.asarray(_select(layout, layer, "triton")(cache, q8[:1, 3:], wf[:1, 3:], jnp.asarray(table[:1]),
                                                          jnp.asarray(pos[:1, 3:])))
    np.testing.assert_array_equal(shifted, both[3:200])


@pytest.mark.gpu
@pytest.mark.parametrize("next_n", [1, 3])
def test_tc_decode_select_tokens_follows_the_contract(rng, next_n):
    """Decode batches (next_n query rows per request, the split top-k): the selected pools
    equal the golden selection on every decided row, the tail columns the reference's;
    the same indices run to run and for a request alone or in the batch; order="pool"
    gives the same tokens in pool order."""
    _require_triton()
    b = 24
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, b=b, n=next_n, max_pages=40)
    c = layout.config
    n_pools = table.shape[1] * s.page_rows
    last = rng.integers(next_n + 2100, n_pools * c.kpool, b)
    pos = (last[:, None] - np.arange(next_n)[::-1][None, :]).astype(np.int32)
    pos[-1, :] = -1 if next_n > 1 else pos[-1, :]                # a padding request
    k = 64
    f = jax.jit(lambda cc, q, w, t, p: ops.select_tokens(cc, layout, layer, q, w, t, p, topk_tokens=k * c.kpool,
                                                          short_context=False, implementation="triton"))
    args = (cache, q8, wf, jnp.asarray(table), jnp.asarray(pos))
    got = np.asarray(f(*args))
    np.testing.assert_array_equal(np.asarray(f(*args)), got)
    alone = np.asarray(f(cache, q8[1:2], wf[1:2], jnp.asarray(table[1:2]), jnp.asarray(pos[1:2])))
    np.testing.assert_array_equal(alone, got[next_n:2 * next_n])
    by_pool = np.asarray(jax.jit(lambda cc, q, w, t, p: ops.select_tokens(
        cc, layout, layer, q, w, t, p, topk_tokens=k * c.kpool, short_context=False, implementation="triton",
        order="pool"))(*args))
    np.testing.assert_array_equal(by_pool, in_pool_order(got, k * c.kpool))
    assert (by_pool != got).any()
    seq = np.where(pos >= 0, pos + 1, 0)
    ctx = seq // c.kpool
    gold, e = golden(cache, layout, layer, q8, wf, table, ctx)
    gold, e, ctx, seq = gold.reshape(b * next_n, -1), e.reshape(b * next_n, -1), ctx.reshape(-1), seq.reshape(-1)
    decided = decided_rows(gold, e, ctx, k)
    assert decided.size >= 0.2 * b * next_n                      # the check is not vacuous
    want = np_expand(np_topk(gold, ctx, k), seq, c.kpool)
    sel = lambda x: np.sort(x[:, :k * c.kpool].reshape(x.shape[0], k, c.kpool)[..., 0], axis=1)   # noqa: E731
    np.testing.assert_array_equal(sel(got[decided]), sel(want[decided]))
    np.testing.assert_array_equal(got[:, k * c.kpool:], want[:, k * c.kpool:])


@pytest.mark.gpu
def test_tc_decode_select_tokens_in_chunks_equals_one_chunk(rng):
    """Speculative decode rows (3 per request) through the split top-k in chunks of one
    row per request (lax.map over 3 chunks; the logits kernel's counters feed the
    candidates launch and the rank launch through aliased outputs) give the indices of
    the same rows in one chunk."""
    _require_triton()
    b, next_n, k = 24, 3, 64
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, b=b, n=next_n, max_pages=40)
    c = layout.config
    n_pools = table.shape[1] * s.page_rows
    last = rng.integers(next_n + 2100, n_pools * c.kpool, b)
    pos = (last[:, None] - np.arange(next_n)[::-1][None, :]).astype(np.int32)
    tokens_per_row = k * c.kpool + c.kpool - 1                     # the split top-k's token columns
    ws = b * workspace.chunk_row_bytes(n_pools, k, tokens_per_row=tokens_per_row)
    assert workspace.rows_per_chunk(next_n, n_pools, k, b, ws, tokens_per_row=tokens_per_row) == 1

    def select(ws_):
        return jax.jit(lambda cc, q, w, t, p: ops.select_tokens(cc, layout, layer, q, w, t, p, topk_tokens=k * c.kpool,
                                                                 short_context=False, implementation="triton",
                                                                 workspace_bytes=ws_))
    args = (cache, q8, wf, jnp.asarray(table), jnp.asarray(pos))
    one = np.asarray(select(None)(*args))
    loops = lambda ws_: select(ws_).lower(*args).as_text().count("stablehlo.while")   # noqa: E731
    assert loops(ws) > loops(None)                                 # the chunks run in a loop, one chunk does not
    np.testing.assert_array_equal(np.asarray(select(ws)(*args)), one)


@pytest.mark.gpu
def test_tc_select_tokens_is_the_default_for_prefill_rows(rng):
    """implementation=None on the GPU: Triton for prefill rows, Pallas for decode rows
    (whatever the batch), for a named Pallas path and for the other read ops."""
    _require_triton()
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, n=ops.TC_MIN_ROWS)
    assert ops._read_impl("select_tokens", None, s, 32, ops.TC_MIN_ROWS) == "triton"
    assert ops._read_impl("select_tokens", None, s, 32, 1 << 16) == "triton"
    assert ops._read_impl("select_tokens", None, s, 32, ops.TC_MIN_ROWS - 1) == "pallas"
    assert ops._read_impl("select_tokens", None, s, 32, 1) == "pallas"
    assert ops._read_impl("select_tokens", None, s, 32, None) == "pallas"
    assert ops._read_impl("paged_logits", None, s, 32) == "pallas"


@pytest.mark.gpu
def test_tc_decode_and_prefill_routes_select_the_same_tokens(rng):
    """The Triton path's two top-k routes read the same logit bits: a request's rows
    selected as one prefill chunk (one program per row) and as decode rows of as many
    requests (the split top-k) give the same token indices, bit for bit, rows whose
    logits are all zero (ties everywhere, decided by pool id) and rows shorter than k
    included."""
    _require_triton()
    n = ops.TC_MIN_ROWS + 32
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, b=1, n=n, max_pages=40)
    c = layout.config
    n_pools = table.shape[1] * s.page_rows
    k = 64
    pos = np.sort(rng.choice(np.arange(2000, n_pools * c.kpool), n, replace=False)).astype(np.int32)
    pos[:3] = [5, 17, 4 * k - 9]                                  # fewer than k pools: the whole context
    wf = np.asarray(wf).copy()
    wf[0, [10, 40, 70]] = 0.0                                    # all-zero logits
    f = jax.jit(lambda cc, q, w, t, p: ops.select_tokens(cc, layout, layer, q, w, t, p, topk_tokens=k * c.kpool,
                                                          short_context=False, implementation="triton"))
    prefill = np.asarray(f(cache, q8, jnp.asarray(wf), jnp.asarray(table), jnp.asarray(pos[None, :])))
    rows = jnp.asarray(np.repeat(table, n, axis=0))
    decode = np.asarray(f(cache, jnp.asarray(q8).reshape(n, 1, *q8.shape[2:]), jnp.asarray(wf).reshape(n, 1, -1),
                          rows, jnp.asarray(pos[:, None])))
    np.testing.assert_array_equal(decode, prefill)
    zero = prefill[10, :k * c.kpool:c.kpool]
    np.testing.assert_array_equal(zero, np.arange(k) * c.kpool)    # the plateau: the lowest pool ids


@pytest.mark.gpu
def test_tc_launches_are_typed_ffi_calls(rng):
    """The decode split path compiles to its three kernels as jaxlib's typed-FFI Triton
    calls (the form XLA captures in its command buffers), none as the legacy target;
    and a jax_triton call that names no target keeps jax_triton's own lowering."""
    _require_triton()
    layout, layer, s, cache, q8, wf, table, _ = tc_case(rng, b=2, n=1, max_pages=40)
    pos = jnp.full((2, 1), table.shape[1] * s.page_rows * layout.config.kpool - 1, jnp.int32)
    hlo = _select(layout, layer, "triton").lower(cache, q8, wf, jnp.asarray(table), pos).compile().as_text()
    assert hlo.count(f'custom_call_target="{_call.FFI_TARGET}"') == 3, "logits, candidates, rank"
    assert f'custom_call_target="{_call.LEGACY_TARGET}"' not in hlo

    import jax_triton as jt
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, tl.load(x_ptr + i) + 1)

    x = jnp.arange(16, dtype=jnp.int32)
    f = jax.jit(lambda v: jt.triton_call(v, kernel=add_one, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32),
                                         grid=(1,), N=16))
    plain = f.lower(x).compile().as_text()
    assert f'custom_call_target="{_call.LEGACY_TARGET}"' in plain and _call.FFI_TARGET not in plain
    np.testing.assert_array_equal(np.asarray(f(x)), np.arange(1, 17))
