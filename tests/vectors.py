"""Loaders for the vLLM conformance vectors in tests/data/vllm_vectors (see its README).

The vectors ship with the repository, so a missing file is an error, not a skip:
``available()`` raises ``FileNotFoundError`` naming what is missing (the tests'
``skipif(not available())`` guards never skip), and so does ``load``.
``GLM5_VECTORS=<dir>`` reads another copy of the same files.
"""
from __future__ import annotations

import os
import pathlib

import ml_dtypes
import numpy as np

from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout

REPO_VECTORS = pathlib.Path(__file__).resolve().parent / "data" / "vllm_vectors"
VECTORS = pathlib.Path(os.environ.get("GLM5_VECTORS", REPO_VECTORS))
NAMES = ("vllm_compress", "vllm_seed_padded_stride", "vllm_prefill_decode")


def _path(name) -> pathlib.Path:
    path = VECTORS / f"{name}.npz"
    if not path.is_file():
        where = "GLM5_VECTORS" if "GLM5_VECTORS" in os.environ else "the repository"
        raise FileNotFoundError(f"vLLM conformance vector {path} is missing ({where}; the files ship "
                                f"in tests/data/vllm_vectors, see its README)")
    return path


def available() -> bool:
    """True when every vector file is present; a missing one raises FileNotFoundError."""
    for name in NAMES:
        _path(name)
    return True


def bf16(bits):
    return np.asarray(bits).astype(np.int16).view(ml_dtypes.bfloat16)


def load(name):
    return dict(np.load(_path(name)))


def compress_case():
    """vllm_compress: 1024 pools into 64 pages of 32 rows (one layer, block = one page).

    vLLM's kernel test writes pages 0 .. 63, page 0 included, but block 0 of a layer here
    is the null block that no writer touches. So the layout gets one block more and the
    recorded pages become blocks 1 .. 64: slots shift by one block, and the expected
    bytes are one all-zero block (the untouched null block) and then the recorded ones."""
    d = load("vllm_compress")
    page_rows = int(d["page_rows"])
    n_pools = d["loc"].shape[0]
    cfg = IndexerConfig(block_size=page_rows * 4)            # S = 32 -> one 32-row page per block
    layout = CacheLayout(cfg, num_layers=1, num_blocks=d["cache_bytes"].size // cfg.index_block_bytes + 1)
    key = bf16(d["key_bf16_bits"]).reshape(n_pools * 4, 128)
    gate = bf16(d["gate_bf16_bits"]).reshape(n_pools * 4, 128)
    slot = np.full(n_pools * 4, -1, np.int32)
    slot[3::4] = d["loc"] + cfg.pools_per_block
    want = np.concatenate([np.zeros(cfg.index_block_bytes, np.uint8), d["cache_bytes"]])
    return layout, key, gate, d["ape"], slot, want


def seed_case():
    d = load("vllm_seed_padded_stride")
    cfg = IndexerConfig(block_size=int(d["block_bytes"]) // 132 * int(d["kpool"]), kpool=int(d["kpool"]))
    assert cfg.ring == int(d["ring"]) and cfg.index_block_bytes == int(d["block_bytes"])
    layout = CacheLayout(cfg, num_layers=1, num_blocks=int(d["num_blocks"]))
    return (layout, int(d["sentinel"]), bf16(d["key_bf16_bits"]), bf16(d["gate_bf16_bits"]),
            d["tslot"].astype(np.int32), d["buffer_bytes"])


def prefill_decode_case():
    d = load("vllm_prefill_decode")
    cfg = IndexerConfig(block_size=int(d["block_size"]), kpool=int(d["kpool"]))
    assert cfg.ring == int(d["ring"])
    layout = CacheLayout(cfg, num_layers=1, num_blocks=int(d["num_blocks"]))
    steps = []
    i = 0
    while f"decode{i}_positions" in d:
        steps.append(dict(positions=d[f"decode{i}_positions"].astype(np.int32),
                          slot_mapping=d[f"decode{i}_slot_mapping"].astype(np.int32),
                          tslot=d[f"decode{i}_tslot"].astype(np.int32),
                          key=bf16(d[f"decode{i}_key_bf16_bits"]),
                          gate=bf16(d[f"decode{i}_gate_bf16_bits"])))
        i += 1
    prefill = dict(key=bf16(d["prefill_key_bf16_bits"]), gate=bf16(d["prefill_gate_bf16_bits"]),
                   slot_mapping=d["prefill_slot_mapping"].astype(np.int32),
                   tslot=d["prefill_tslot"].astype(np.int32))
    return layout, int(d["sentinel"]), d["ape"], prefill, steps, d["buffer_bytes"]


def cache_bytes(cache, n=None):
    b = np.asarray(cache).view(np.uint8)
    return b if n is None else b[:n]
