"""Random workloads and a paging-free golden model, for tests, notebooks and benchmarks.

``Scenario`` places a few requests in a layout (distinct indexer and tail blocks
drawn at random from 1..num_blocks-1), draws fresh random K / gate rows for every
token, and builds the metadata of a prefill of the first ``prefill_tokens`` of
each request and of decode steps for the rest. ``golden_pools`` computes every
complete pool of a request straight from its token stream (docs/semantics.md,
appendix C: no pages, no ring), which the paged cache must reproduce byte for byte.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.core import numerics as nm

from . import metadata as md
from .config import IndexerConfig
from .layout import CacheLayout


@jax.jit
def _golden_compress(k, g, ape):
    """Pools straight from token rows k, g [m, R, 128] (no pages, no ring)."""
    r = k.shape[1]
    return nm.compress_pool([k[:, j] for j in range(r)], [g[:, j] for j in range(r)],
                            [ape[j] for j in range(r)])


@dataclasses.dataclass
class Request:
    length_tokens: int
    index_blocks: np.ndarray          # [n_blocks] manager block ids for the indexer pages
    tail_block: int
    key: np.ndarray                   # [L, 128] bf16
    gate: np.ndarray                  # [L, 128] bf16


def random_rows(rng: np.random.Generator, n: int, scale: float = 1.0):
    """[n, 128] bf16 rows with per-row magnitudes spread over several decades."""
    mag = np.exp(rng.uniform(np.log(1e-3), np.log(300.0), size=(n, 1))) * scale
    return (rng.standard_normal((n, 128)) * mag).astype(ml_dtypes.bfloat16)


def random_ape(rng: np.random.Generator, kpool: int):
    return (rng.standard_normal((kpool, 128)) * 0.5).astype(np.float32)


@dataclasses.dataclass
class Scenario:
    layout: CacheLayout
    layer: int
    requests: list
    ape: np.ndarray

    @classmethod
    def random(cls, rng: np.random.Generator, layout: CacheLayout, lengths_tokens, layer: int = 0):
        c = layout.config
        need = [max(1, -(-L // c.block_size)) for L in lengths_tokens]
        total = sum(need) + len(lengths_tokens)
        if total > layout.num_blocks - 1:
            raise ValueError(f"scenario needs {total} blocks, layout has {layout.num_blocks - 1} usable")
        ids = rng.permutation(np.arange(1, layout.num_blocks))[:total]
        reqs, k = [], 0
        for L, nb in zip(lengths_tokens, need):
            blocks = ids[k:k + nb]; k += nb
            tail = int(ids[k]); k += 1
            gate = random_rows(rng, L) if L else np.zeros((0, 128), ml_dtypes.bfloat16)
            reqs.append(Request(L, blocks, tail, random_rows(rng, L), gate))
        return cls(layout, layer, reqs, random_ape(rng, c.kpool))

    # ---- ownership ---------------------------------------------------------------
    def owned_byte_ranges(self):
        """[start, end) byte ranges this scenario may write: its indexer blocks and tail blocks."""
        out = []
        for r in self.requests:
            for b in list(r.index_blocks) + [r.tail_block]:
                out.append(self.layout.block_byte_range(self.layer, int(b)))
        return out

    def unowned_mask(self):
        m = np.ones(self.layout.total_bytes, bool)
        for a, b in self.owned_byte_ranges():
            m[a:b] = False
        return m

    # ---- metadata ------------------------------------------------------------------
    def _tables(self):
        c = self.layout.config
        width = max(len(r.index_blocks) for r in self.requests)
        bt = np.zeros((len(self.requests), width), np.int64)
        for i, r in enumerate(self.requests):
            bt[i, :len(r.index_blocks)] = r.index_blocks
        return md.page_table_pages(bt, c), np.array([r.tail_block for r in self.requests])

    def prefill(self, upto_tokens, pad_to: int | None = None):
        """Flat prefill batch of tokens [0, upto_r) of every request (chunk from 0)."""
        c = self.layout.config
        upto = [int(u) for u in upto_tokens]
        pages, tails = self._tables()
        pos = md.token_positions(upto, upto, pad_to)
        req = md.token_request_index(upto, pad_to)
        n = pos.shape[0]
        key = np.zeros((n, 128), ml_dtypes.bfloat16)
        gate = np.zeros((n, 128), ml_dtypes.bfloat16)
        k = 0
        for r, u in zip(self.requests, upto):
            key[k:k + u] = r.key[:u]
            gate[k:k + u] = r.gate[:u]
            k += u
        slot = md.compressed_slot_mapping(pos, req, pages, c)
        tslot = md.tail_slot_mapping(pos, req, tails, c)
        return dict(key=key, gate=gate, slot_mapping=slot, tslot=tslot)

    def decode(self, start_tokens, counts, width: int):
        """[B, width] decode batch: request r takes tokens start_r .. start_r + count_r - 1."""
        c = self.layout.config
        pages, tails = self._tables()
        b = len(self.requests)
        pos = np.full((b, width), -1, np.int32)
        key = np.zeros((b, width, 128), ml_dtypes.bfloat16)
        gate = np.zeros((b, width, 128), ml_dtypes.bfloat16)
        for i, (r, s0, n) in enumerate(zip(self.requests, start_tokens, counts)):
            if s0 + n > r.length_tokens:
                raise ValueError("decode past the request's length")
            pos[i, :n] = np.arange(s0, s0 + n)
            key[i, :n] = r.key[s0:s0 + n]
            gate[i, :n] = r.gate[s0:s0 + n]
        req = np.where(pos >= 0, np.arange(b)[:, None], -1)
        slot = md.compressed_slot_mapping(pos.ravel(), req.ravel(), pages, c).reshape(b, width)
        tslot = md.tail_slot_mapping(pos.ravel(), req.ravel(), tails, c).reshape(b, width)
        return dict(key=key, gate=gate, slot_mapping=slot, tslot=tslot, positions=pos)

    # ---- golden model --------------------------------------------------------------
    def golden_pools(self, req_index: int, upto_tokens: int | None = None):
        """(fp8 bytes [m, 128] uint8, scales [m] f32) of the complete pools of a request."""
        r = self.requests[req_index]
        R = self.layout.config.kpool
        L = r.length_tokens if upto_tokens is None else upto_tokens
        m = L // R
        if m == 0:
            return np.zeros((0, 128), np.uint8), np.zeros((0,), np.float32)
        mb = -(-m // 64) * 64                      # pad: one compile per 64 pools, not per count
        k = np.zeros((mb, R, 128), ml_dtypes.bfloat16)
        g = np.zeros((mb, R, 128), ml_dtypes.bfloat16)
        k[:m] = r.key[:m * R].reshape(m, R, 128)
        g[:m] = r.gate[:m * R].reshape(m, R, 128)
        q8, scale = _golden_compress(jnp.asarray(k), jnp.asarray(g), jnp.asarray(self.ape, jnp.float32))
        return np.asarray(q8)[:m].view(np.uint8), np.asarray(scale)[:m]

    def pool_slots(self, req_index: int, n_pools: int):
        """Pool slots of pools 0 .. n_pools-1 of a request, through the metadata builders."""
        c = self.layout.config
        pages, _ = self._tables()
        pos = np.arange(n_pools) * c.kpool + c.kpool - 1
        return md.compressed_slot_mapping(pos, np.full(n_pools, req_index), pages, c)

    def check_cache(self, cache, upto_tokens, sentinel: int, *, check_tail=True):
        """Assert the cache holds exactly the golden pools and tails, and sentinel elsewhere.

        upto_tokens[r]: tokens of request r processed so far. Returns a summary dict.
        """
        lay, c = self.layout, self.layout.config
        raw = np.asarray(cache).view(np.uint8)
        keys, scales = lay.pool_keys(cache, self.layer)
        keys = keys.view(np.uint8)
        tk, tg = lay.tail_ring(cache, self.layer)
        n_pools = 0
        for i, (r, u) in enumerate(zip(self.requests, upto_tokens)):
            gk, gs = self.golden_pools(i, u)
            slots = self.pool_slots(i, gk.shape[0])
            np.testing.assert_array_equal(keys[slots], gk, err_msg=f"request {i}: pool keys")
            np.testing.assert_array_equal(scales[slots].view(np.uint32), gs.view(np.uint32),
                                          err_msg=f"request {i}: pool scales")
            n_pools += gk.shape[0]
            if check_tail and u > 0:
                # the ring holds the last min(u, ring) tokens' ... at least the incomplete pool
                first = (u // c.kpool) * c.kpool
                for p in range(first, u):
                    np.testing.assert_array_equal(
                        tk[r.tail_block, p % c.ring].view(np.uint16), r.key[p].view(np.uint16),
                        err_msg=f"request {i}: tail K of position {p}")
                    np.testing.assert_array_equal(
                        tg[r.tail_block, p % c.ring].view(np.uint16), r.gate[p].view(np.uint16),
                        err_msg=f"request {i}: tail gate of position {p}")
        outside = self.unowned_mask()
        stray = np.nonzero(raw[outside] != sentinel)[0]
        assert stray.size == 0, (f"{stray.size} bytes outside the requests' own blocks changed; "
                                 f"first at byte {np.nonzero(outside)[0][stray[0]]}")
        return dict(pools=n_pools)
