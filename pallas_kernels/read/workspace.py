"""Host-side planning of the tensor-core read path: workspace bounds and tile geometry.

Plain Python (no jax, no triton): the same rules run on a CPU, where they are
tested, and decide the launches on the GPU.

A prefill selection scores [rows, pools] logits; the Triton path never holds more
of them than one chunk of query rows at a time. Per query row, per request of the
batch, a chunk needs the row's logits (4 bytes per pool column), the top-k's
candidate buffers and the row's k ids.
"""
from __future__ import annotations

DEFAULT_WORKSPACE_BYTES = 1 << 30      # the chunk's device workspace unless the caller sets one
LOGIT_BYTES = 4                        # f32 per (row, pool column)
TC_PAGE_ROWS = (16, 32, 64)            # P: G * P = 64 pool rows per MMA step
TC_HEADS = (32, 64)                    # padded heads: BQ * Hp dot columns
MAXIMA_GROUP_POOLS = 8                 # logit columns per group maximum the logits kernel writes
MAXIMA_STEP_POOLS = 64                 # columns of one MMA step of the logits kernel: 8 groups
FLOOR_MAXIMA = 8192                    # maxima per row the split top-k's floor holds in one tile
LOGITS_MIN_PROGRAMS = 528              # logits programs a decode batch spreads over: 4 per SM of the H200 (132 SMs)
SPLIT_PROGRAMS = 264                   # candidate and rank programs of the split top-k: 2 per SM (docs/benchmarks.md)
MAX_GRID_ROWS = 65535                  # CUDA's limit on a grid's second axis: the split top-k's rows
SAMPLE_POOLS = 16384                   # the most scores the dense top-k samples per row for its guess
SAMPLE_MIN_POOLS = 2048                # the fewest (sample_pools)
SAMPLE_CHUNKS = 64                     # runs of consecutive columns a sample takes, spread over the row
SAMPLE_RANK_AIM = 128                  # the rank in its sample a guess aims at: the sample's size follows
MIN_SAMPLE_RANK = 64                   # the least rank in its sample a guess is taken at (dense_topk_takes)
SAMPLE_TARGET_PER_K = 2                # scores per k the dense top-k's guess aims to let through
DENSE_CANDIDATES_PER_KP = 4            # candidates per padded k the dense top-k's select holds
REGISTER_ROW_POOLS = 4096              # the longest row the row top-k reads into registers (topk_rows.Tuning)
DENSE_MANY_ROWS = 256                  # rows from which rows of <= 2 REGISTER_ROW_POOLS take one program each


def padded_k(k: int) -> int:
    """KP: the width of the top-k's selected and edge buffers, the next power of two >= k."""
    return 1 << (int(k) - 1).bit_length()


def candidate_cap(k: int) -> int:
    """CAP: the entries of the top-k's candidate buffer per row (the scores of KP groups)
    and of its list of group ids. A row with more groups, or more scores, at or above
    the maxima's floor runs the whole-row walk instead."""
    return MAXIMA_GROUP_POOLS * padded_k(k)


def topk_scratch_bytes_per_row(k: int) -> int:
    """The top-k's private buffers per row: u32 keys and i32 ids of 2 KP selected and edge
    entries plus the candidate buffer, and the i32 ids of up to that many groups."""
    cap = candidate_cap(k)
    return (2 * padded_k(k) + cap) * 8 + cap * 4


def maxima_cols(n_cols_pools: int, group_pools: int = MAXIMA_GROUP_POOLS) -> int:
    """Maxima per row of logits: MAXIMA_STEP_POOLS // group_pools per step of
    MAXIMA_STEP_POOLS columns (rounded up); group_pools is 8 (``group_columns``) or 64
    (one maximum per step: columns 64 s .. 64 s + 63)."""
    if group_pools not in (MAXIMA_GROUP_POOLS, MAXIMA_STEP_POOLS):
        raise ValueError(f"maxima cover {MAXIMA_GROUP_POOLS} or {MAXIMA_STEP_POOLS} pools, got {group_pools}")
    return -(-n_cols_pools // MAXIMA_STEP_POOLS) * (MAXIMA_STEP_POOLS // group_pools)


def split_maxima_pools(n_cols_pools: int) -> int:
    """Pools per maximum on the split (small-batch) path: groups of 8 while a row has at
    most FLOOR_MAXIMA of them (up to 64k pools, 256k tokens), whole steps of 64 above
    that, so the floor holds a row's maxima in one tile up to 512k pools (2M tokens).
    A row needs at least k whole-step maxima for a floor: with steps, k above 1024
    leaves rows of 64k-128k pools without one (exact, through the whole-row walk)."""
    small = maxima_cols(n_cols_pools, MAXIMA_GROUP_POOLS) <= FLOOR_MAXIMA
    return MAXIMA_GROUP_POOLS if small else MAXIMA_STEP_POOLS


def dense_topk_takes(rows: int, n_cols_pools: int, k: int) -> bool:
    """Whether ``topk_pools(implementation="triton")`` takes the sampled three-launch
    form (``triton_lang.dense_topk``) rather than one program per row
    (``triton_lang.topk_rows``): for rows longer than the row form holds in registers
    (REGISTER_ROW_POOLS), unless they are both many (DENSE_MANY_ROWS or more, which
    fill the GPU one program each) and short (at most twice the registers' width): the
    row form measured faster there (docs/benchmarks.md), as many rows as a grid axis holds, and a sample
    that ranks the guess at least MIN_SAMPLE_RANK deep. The count a guess lets through is off
    from its aim by about 1 / sqrt(rank) (12.5 % at 64), so a row falls short of k, and
    is walked whole, at 4 standard deviations: about 3 rows in 100,000 of random
    scores. Shallower samples (k = 512 past 256k pools) would miss far more often."""
    if not (0 < rows <= MAX_GRID_ROWS and n_cols_pools > REGISTER_ROW_POOLS):
        return False
    if rows >= DENSE_MANY_ROWS and n_cols_pools <= 2 * REGISTER_ROW_POOLS:
        return False
    return sample_rank(n_cols_pools, min(n_cols_pools, sample_pools(n_cols_pools, k)), k) >= MIN_SAMPLE_RANK


def sample_pools(n_cols_pools: int, k: int) -> int:
    """The scores the dense top-k samples of each row of n_cols_pools for its guess: the
    least power of two from SAMPLE_MIN_POOLS that ranks the guess SAMPLE_RANK_AIM deep
    (or holds the whole row), at most SAMPLE_POOLS: at 128k pools, 16,384 scores for
    k = 512 and 4,096 for k = 2048. The sample launch's work (one program per row, 16
    block-wide counts over its sample) scales with the sample (docs/benchmarks.md, "The
    sample's size"). At rank 128 the count a guess lets through is off from its aim by
    about 9 %."""
    m = SAMPLE_MIN_POOLS
    while m < SAMPLE_POOLS and m < n_cols_pools and sample_rank(n_cols_pools, m, k) < SAMPLE_RANK_AIM:
        m *= 2
    return m


def sample_chunk_pools(sampled_pools: int) -> int:
    """Consecutive columns per run of a sample of sampled_pools scores (SAMPLE_CHUNKS
    runs): 32 to 256, multiples of 128 bytes."""
    return sampled_pools // SAMPLE_CHUNKS


def sample_stride(n_cols_pools: int, sampled_pools: int) -> int:
    """Pools from one sampled run to the next in the dense top-k's sample of
    sampled_pools scores of a row of n_cols_pools (``triton_lang.topk_sample``): the row
    split evenly among SAMPLE_CHUNKS runs, rounded down to whole runs, at least one run
    (the sample is then the row's first columns, or all of them)."""
    chunk_pools = sample_chunk_pools(sampled_pools)
    return max(n_cols_pools // SAMPLE_CHUNKS // chunk_pools * chunk_pools, chunk_pools)


def sample_rank(n_cols_pools: int, sampled_pools: int, k: int, target: int = SAMPLE_TARGET_PER_K) -> int:
    """The rank in its sample of the dense top-k's guess for a row of n_cols_pools
    scores, sampled_pools of them sampled: min(k, n) when the sample is the whole row
    (the guess is then a floor), else target * k scaled to the sample, rounded up."""
    if sampled_pools >= n_cols_pools:
        return min(k, n_cols_pools)
    return min(-(-target * k * sampled_pools // n_cols_pools), sampled_pools)


def dense_candidates(k: int) -> int:
    """W: the candidates per row the dense top-k's select launch holds in registers,
    DENSE_CANDIDATES_PER_KP * KP (twice what the guess aims at)."""
    return DENSE_CANDIDATES_PER_KP * padded_k(k)


def logits_pages_per_program(max_pages: int, other_programs: int, pages_per_step: int,
                             pages_max: int, min_programs: int) -> int:
    """Page-table columns per logits program: pages_max, halved (down to one step of
    pages_per_step) while the grid would have fewer than `min_programs` programs
    (LOGITS_MIN_PROGRAMS for decode rows, 0 for prefill chunks), so a small batch
    still spreads its reads over every SM. other_programs: the grid's programs per
    column block (query-row blocks x requests)."""
    pages = max(pages_max, pages_per_step)
    while pages > pages_per_step and other_programs * -(-max_pages // pages) < min_programs:
        pages //= 2
    return pages


def split_spans(rows: int, n_cols_pools: int, block: int, programs: int = SPLIT_PROGRAMS) -> tuple[int, int]:
    """(spans per row, pools per span) of the split top-k's candidate launch: about
    `programs` programs (rows x spans) where the rows are long enough, each span a
    multiple of `block`. Every program finds its row's floor for itself, so more
    programs cost more than they read faster."""
    blocks = max(1, -(-n_cols_pools // block))
    spans = max(1, min(-(-programs // max(1, rows)), blocks))
    span_pools = -(-blocks // spans) * block
    return -(-n_cols_pools // span_pools) if n_cols_pools else 1, span_pools


def rank_programs(rows: int, cap_candidates: int, tile_candidates: int, programs: int = SPLIT_PROGRAMS) -> int:
    """Programs per row of the split top-k's rank launch: at most `programs` in all (one
    wave: the kernel's registers leave room for 2 programs per SM) unless that is less
    than one per row, each ranking whole tiles of `tile_candidates`, at most one per
    tile of the row's candidate buffer (`cap_candidates` entries)."""
    return max(1, min(-(-cap_candidates // tile_candidates), programs // max(1, rows)))


def group_columns(group: int) -> list[int]:
    """The 8 logit columns of maximum `group`: in step s = group // 8 (columns 64 s ..
    64 s + 63), group j = group % 8 = 2 w + a holds columns 64 s + 16 w + 4 a + {0, 1,
    2, 3, 8, 9, 10, 11}: the rows one thread and three lanes of warp w hold in the MMA
    accumulator (one register pair, lane bits 2-3), so the maximum needs one compare in
    registers and two shuffle levels."""
    s, j = divmod(int(group), MAXIMA_STEP_POOLS // MAXIMA_GROUP_POOLS)
    base = MAXIMA_STEP_POOLS * s + 16 * (j // 2) + 4 * (j % 2)
    return [base + h * 8 + i for h in range(2) for i in range(4)]


def chunk_row_bytes(n_cols_pools: int, k: int, tokens_per_row: int = 0) -> int:
    """Workspace bytes one query row of one request takes in a chunk: logits, group
    maxima (u32), top-k buffers, the k ids and `tokens_per_row` i32 token indices (the
    split top-k writes them in its chunk)."""
    return (n_cols_pools * LOGIT_BYTES + maxima_cols(n_cols_pools) * 4 + topk_scratch_bytes_per_row(k)
            + 4 * k + 4 * tokens_per_row)


def rows_per_chunk(n_rows: int, n_cols_pools: int, k: int, batch: int = 1,
                   workspace_bytes: int | None = None, tokens_per_row: int = 0) -> int:
    """Query rows per chunk (per request) so that a chunk's workspace stays within
    `workspace_bytes` (default DEFAULT_WORKSPACE_BYTES); at least 1, at most n_rows."""
    ws = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    check_workspace_bytes(ws)
    per_row = max(1, batch) * chunk_row_bytes(n_cols_pools, k, tokens_per_row)
    if ws < per_row:
        raise ValueError(f"workspace_bytes={ws} does not hold one query row: a row of {batch} request(s) "
                         f"over {n_cols_pools} pools with k = {k} takes {per_row} bytes")
    return max(1, min(n_rows, ws // per_row))


def check_workspace_bytes(workspace_bytes) -> None:
    if not isinstance(workspace_bytes, int) or isinstance(workspace_bytes, bool) or workspace_bytes < 1:
        raise ValueError(f"workspace_bytes must be a positive int (bytes), got {workspace_bytes!r}")


def check_tc_geometry(page_rows: int, hp: int, key_rows_16b_aligned: bool) -> None:
    """The tensor-core kernels' tiles: P in TC_PAGE_ROWS, Hp in TC_HEADS, key rows
    16-byte aligned (vector loads)."""
    if page_rows not in TC_PAGE_ROWS:
        raise ValueError(f"the Triton read kernels need page_rows in {TC_PAGE_ROWS}, got {page_rows}")
    if hp not in TC_HEADS:
        raise ValueError(f"the Triton read kernels need {TC_HEADS} (padded) heads, got {hp}")
    if not key_rows_16b_aligned:
        raise ValueError("the Triton read kernels need 16-byte aligned key rows")
