"""GPU diagnosis of the 9 GiB case (word offsets past 2**31): which implementation is wrong?

Usage: python tests/scripts/large_cache_diag.py [GIB] [SEEDS]   (defaults: 9, 3)

For each seed, the workload of tests/test_triton.py::test_triton_large_cache
(prefill, seed, decode of 4 tokens into the cache's last blocks) runs through
the XLA reference, the Triton kernels and the Pallas kernels. Every differing
word of every pair is printed with its place (layer, indexer block, byte offset
in the block) and its three values. When any pair differs, each cache is also
checked against the paging-free golden model (Scenario.check_cache), which says
which side is wrong. Prints 'DIAG OK' when all three agree on every seed.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario
from pallas_kernels.core import addressing as addr
from pallas_kernels.core.strides import VIEW_COLS, WORD_BYTES

GIB = int(sys.argv[1]) if len(sys.argv) > 1 else 9
SEEDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
SENTINEL = 0x5A


def workload(seed):
    rng = np.random.default_rng(seed)
    cfg = IndexerConfig()
    blocks = 4096
    layers = -(-GIB * 2**30 // (blocks * cfg.index_block_bytes))
    layout = CacheLayout(cfg, num_layers=layers, num_blocks=blocks)
    layer = layers - 1
    sc = Scenario.random(rng, layout, [2000, 999, 5], layer=layer)
    sc.requests[0].index_blocks = np.array([blocks - 3, blocks - 2])
    sc.requests[0].tail_block = blocks - 1
    return layout, layer, sc, sc.prefill([1990, 999, 5]), sc.decode([1990, 999, 5], [4, 0, 0], 4)


def run(impl, layout, layer, sc, pre, st):
    a = {k: jnp.asarray(v) for k, v in pre.items()}
    d = {k: jnp.asarray(v) for k, v in st.items()}
    ape = jnp.asarray(sc.ape)
    c = layout.allocate(SENTINEL)
    c = ops.compress_prefill(c, layout, layer, a["key"], a["gate"], ape, a["slot_mapping"], implementation=impl)
    c = ops.seed_tail(c, layout, layer, a["key"], a["gate"], a["tslot"], implementation=impl)
    c = ops.decode_update(c, layout, layer, d["key"], d["gate"], ape, d["slot_mapping"], d["tslot"],
                          d["positions"], implementation=impl)
    return jax.block_until_ready(c)


@jax.jit
def diff_places(x, y):
    """(count, rows [16], cols [16]) of differing words in the [rows, 1024] view.
    Rows first, then columns within those rows: a nonzero over all 2**31+ words
    would need 64-bit positions."""
    v = (x != y).reshape(-1, VIEW_COLS)
    n = jnp.sum(jnp.sum(v.astype(jnp.int32), axis=1))
    (r,) = jnp.nonzero(jnp.any(v, axis=1), size=16, fill_value=-1)
    c = jnp.argmax(v[jnp.maximum(r, 0)], axis=1)
    return n, r, jnp.where(r >= 0, c, -1)


def where(layout, word):
    for layer in range(layout.num_layers):
        hit = addr.index_block_of_byte(layout.strides(layer), word * WORD_BYTES)
        if hit is not None:
            return f"layer {layer} block {hit[0]} byte {hit[1]} of the block"
    return "outside every indexer region"


def main():
    print(f"devices: {jax.devices()}; jax {jax.__version__}; {GIB} GiB")
    bad = 0
    for seed in range(SEEDS):
        layout, layer, sc, pre, st = workload(1000 + seed)
        impls = ["xla", "triton", "pallas"]
        out = {i: run(i, layout, layer, sc, pre, st) for i in impls}
        words = {}
        found = False
        for i, j in (("xla", "triton"), ("xla", "pallas"), ("triton", "pallas")):
            n, r, c = (np.asarray(v) for v in diff_places(out[i], out[j]))
            print(f"seed {seed}: {i} vs {j}: {int(n)} words differ")
            for rr, cc in zip(r, c):
                if rr >= 0:
                    words[int(rr) * VIEW_COLS + int(cc)] = True
            found |= int(n) > 0
        for w in sorted(words):
            row, col = (int(v) for v in addr.view_row_col(np.int64(w)))
            vals = {i: f"{int(out[i].reshape(-1, VIEW_COLS)[row, col]):08x}" for i in impls}
            print(f"  word {w} ({where(layout, w)}): {vals}")
        if found:
            bad += 1
            upto = [1994, 999, 5]
            for i in impls:
                try:
                    sc.check_cache(out[i], upto, SENTINEL)
                    print(f"  golden check {i}: OK")
                except AssertionError as e:
                    print(f"  golden check {i}: FAILED: {str(e)[:600]}")
        del out
    print("DIAG OK" if bad == 0 else f"DIAG: {bad} of {SEEDS} seeds differ")


if __name__ == "__main__":
    main()
