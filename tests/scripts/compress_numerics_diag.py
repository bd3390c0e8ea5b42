"""GPU diagnosis: which compress_prefill implementations agree on many random pools?

Usage: python tests/scripts/compress_numerics_diag.py OUT_DIR [TOKENS_PER_REQUEST]

Runs compress_prefill over 4 requests of random rows through the XLA reference,
the Pallas kernel and the Triton kernel with Triton's FMA contraction on (its
default) and off; checks each against the paging-free golden model; prints the
number of pools that differ per pair and saves the inputs and outputs of up to 16
differing pools to OUT_DIR/compress_diffs.npz for offline analysis.
"""
import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario
from pallas_kernels.triton_lang import _call
from pallas_kernels.triton_lang import pool_compress as tpc

OUT = sys.argv[1]
PER = int(sys.argv[2]) if len(sys.argv) > 2 else 65536


def main():
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    cfg = IndexerConfig()
    n_req = 4
    layout = CacheLayout(cfg, num_layers=1, num_blocks=n_req * (PER // cfg.block_size + 2) + 2)
    sc = Scenario.random(rng, layout, [PER] * n_req)
    pre = {k: jnp.asarray(v) for k, v in sc.prefill([PER] * n_req).items()}
    ape = jnp.asarray(sc.ape)
    s = layout.strides(0)

    def triton(fusion):
        launch = tpc.plan(layout.allocate(0x5A), s, pre["key"], pre["gate"], ape, pre["slot_mapping"])
        return _call.run(dataclasses.replace(launch, fp_fusion=fusion))

    caches = {impl: ops.compress_prefill(layout.allocate(0x5A), layout, 0, pre["key"], pre["gate"], ape,
                                         pre["slot_mapping"], implementation=impl) for impl in ("xla", "pallas")}
    caches["triton_fma"] = triton(True)
    caches["triton_nofma"] = triton(False)
    keys = {}
    for name, c in caches.items():
        k, sc_ = layout.pool_keys(c, 0)
        keys[name] = (np.asarray(k).view(np.uint8), np.asarray(sc_).view(np.uint32))
    golden = [sc.golden_pools(i) for i in range(n_req)]
    slots = [sc.pool_slots(i, golden[i][0].shape[0]) for i in range(n_req)]
    total = sum(g[0].shape[0] for g in golden)
    print(f"{total} pools, {n_req} requests x {PER} tokens")
    bad = {}
    for name, (k, scale) in keys.items():
        n = 0
        for i in range(n_req):
            gk, gs = golden[i]
            d = np.nonzero((k[slots[i]] != gk).any(1) | (scale[slots[i]] != gs.view(np.uint32)))[0]
            n += d.size
            bad.setdefault(name, []).extend((i, int(p)) for p in d)
        print(f"{name}: {n} of {total} pools differ from the golden model")
    dump = {}
    for j, (i, p) in enumerate(sorted(set(sum(bad.values(), [])))[:16]):
        r = sc.requests[i]
        R = cfg.kpool
        dump[f"k{j}"] = r.key[p * R:(p + 1) * R].view(np.uint16)
        dump[f"g{j}"] = r.gate[p * R:(p + 1) * R].view(np.uint16)
        dump[f"golden{j}"] = golden[i][0][p]
        for name, (k, scale) in keys.items():
            dump[f"{name}{j}"] = k[slots[i][p]]
            dump[f"{name}_scale{j}"] = scale[slots[i][p]]
    dump["ape"] = sc.ape
    np.savez(f"{OUT}/compress_diffs.npz", **dump)
    print(f"saved {sum(1 for x in dump if x.startswith('golden'))} differing pools")


if __name__ == "__main__":
    main()
