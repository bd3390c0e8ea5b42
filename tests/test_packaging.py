"""What a new user meets first: the package's exports, its typing marker, its version, and
a clear error where an optional extra is missing."""
import pathlib
import re
import sys

import pytest

import glm5_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_public_api_is_exported_from_the_package():
    from glm5_jax import ops
    for name in ("IndexerConfig", "CacheLayout", "ops", "Engine", "seed_tail", "compress_prefill",
                 "decode_update", "fwht_quant", "prepare_queries", "paged_logits", "topk_pools",
                 "expand_pools", "select_tokens"):
        assert getattr(glm5_jax, name) is not None, name
    assert glm5_jax.select_tokens is ops.select_tokens


def test_typed_packages():
    for pkg in ("glm5_jax", "pallas_kernels"):
        assert (ROOT / pkg / "py.typed").exists(), pkg
    assert re.search(r'"py.typed"', (ROOT / "pyproject.toml").read_text())


def test_version_matches_the_changelog():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    top = re.search(r"^## ([0-9][^ ]*)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert version == top


def test_weights_without_safetensors_name_the_extra(monkeypatch, tmp_path):
    from glm5_jax.model import indexer
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ImportError, match=r"glm5-jax\[weights\]"):
        indexer.load_indexer_safetensors(None, tmp_path / "w.safetensors")
    with pytest.raises(ImportError, match=r"glm5-jax\[weights\]"):
        indexer.save_indexer_safetensors(None, tmp_path / "w.safetensors")
