"""`python -m glm5_jax` / `glm5-jax`: the layout planner, the demo, and bad input.

Most cases call ``glm5_jax.__main__.main(argv)`` in process (it returns the exit
code); a few run the real module in a subprocess to cover the entry point itself.
"""
import json
import re
import subprocess
import sys

import pytest

from glm5_jax.__main__ import COMMANDS, main

def _run_module(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "glm5_jax", *args], capture_output=True, text=True,
                          timeout=timeout)


def _table(text: str) -> dict:
    """{'index block bytes': 38016, ...} from the planner's aligned table lines."""
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([a-z][a-z ]*[a-z])\s{2,}([\d,.]+)", line.strip())
        if m:
            out[m.group(1)] = float(m.group(2).replace(",", ""))
    return out


# ---- layout ----------------------------------------------------------------------
def test_layout_default_config(capsys):
    assert main(["layout"]) == 0
    out = capsys.readouterr().out
    t = _table(out)
    # docs/semantics.md 3.2, the PR #57477 row: B = 1152, R = 4
    assert t["block size tokens"] == 1152
    assert t["index block bytes"] == 38_016
    assert t["pages per block"] == 9
    assert t["page rows"] == 32
    assert t["page bytes"] == 4_224
    assert t["tail block stride elems"] == 19_008
    assert t["tail block bytes"] == 2_048
    assert t["num layers"] == 11 and t["num blocks"] == 800
    assert t["bytes per block all layers"] == 11 * 38_016
    assert t["tokens that fit"] == 799 * 1152          # block 0 is the null block
    assert "38,016" in out and "19,008" in out


# (block_size, pools per block, index block bytes, page rows, pages/block, tail stride elems): docs/semantics.md 3.2
SPEC_ROWS = [
    (640, 160, 21_120, 32, 5, 10_560),
    (1024, 256, 33_792, 64, 4, 16_896),
    (1152, 288, 38_016, 32, 9, 19_008),
    (1280, 320, 42_240, 64, 5, 21_120),
    (2176, 544, 71_808, 32, 17, 35_904),
    (3584, 896, 118_272, 64, 14, 59_136),
]


@pytest.mark.parametrize("row", SPEC_ROWS, ids=[f"B{r[0]}" for r in SPEC_ROWS])
def test_layout_json_matches_spec_table(capsys, row):
    bs, s, idx, p, ppb, stride = row
    assert main(["layout", "--json", "--block-size", str(bs), "--num-blocks", "5", "--layers", "3",
                 "--attn-block-bytes", "1024"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["block_size_tokens"], d["pools_per_block"], d["index_block_bytes"], d["page_rows"],
            d["pages_per_block"], d["tail_block_stride_elems"]) == (bs, s, idx, p, ppb, stride)
    assert d["bytes_per_block_all_layers"] == 3 * (1024 + idx)
    assert d["total_bytes"] >= 5 * 3 * (1024 + idx) and d["total_bytes"] % 4096 == 0


@pytest.mark.parametrize("spec_tokens,ring", [(0, 4), (1, 8), (4, 8), (5, 16), (8, 16)])
def test_layout_ring_follows_spec_tokens(capsys, spec_tokens, ring):
    assert main(["layout", "--json", "--spec-tokens", str(spec_tokens)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ring_tokens"] == ring and d["tail_block_bytes"] == 2 * ring * 256


def test_module_entry_point_and_no_jax_import():
    r = _run_module("layout", "--json", "--block-size", "2304")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["index_block_bytes"] == 76_032 and d["tail_block_stride_elems"] == 38_016
    # the planner answers without importing jax
    code = ("import sys, io, contextlib; from glm5_jax.__main__ import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): rc = main(['layout'])\n"
            "assert rc == 0 and 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ---- bad input -------------------------------------------------------------------
BAD = [
    (["layout", "--block-size", "1000"], "multiple of kpool*32"),       # library ValueError
    (["layout", "--block-size", "64", "--spec-tokens", "8"], "tail ring larger"),
    (["layout", "--num-blocks", "1"], "num_blocks must be >= 2"),
    (["layout", "--layers", "0"], "num_layers must be >= 1"),
    (["layout", "--attn-block-bytes", "6"], "attn_block_bytes"),
    (["layout", "--layers", "100000000"], "more than the 8,192.0 GiB its word view can address"),
    (["layout", "--num-blocks", "300000"], "one layer's indexer region (11404800000 B) must stay below 8 GiB"),
    (["layout", "--num-blocks", "-3"], "must be >= 0"),                 # argparse type check
    (["layout", "--num-blocks", "many"], "expected an integer"),
    (["layout", "--bogus"], "unrecognized arguments"),
    (["demo", "--implementation", "cuda"], "invalid choice"),
    (["demo", "--decode-steps", "0"], "--decode-steps"),
    (["demo", "--kpool", "16"], "tail ring larger"),
    (["simulate", "--devices", "0"], "must be >= 1"),
    (["simulate", "--devices", "64", "--no-progress"], "64 devices requested but jax sees"),
    (["frobnicate"], "invalid choice"),
    ([], "a COMMAND is required"),
]


@pytest.mark.parametrize("argv,fragment", BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_bad_input_is_one_clear_line(capsys, argv, fragment):
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert err, "no error message"
    assert "error:" in err[-1] and fragment in err[-1], cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    # library errors print exactly one line (argparse errors add its usage line(s) above)
    if not err[0].startswith("usage:"):
        assert len(err) == 1, cap.err


def test_layout_of_a_huge_cache_answers_at_once():
    """The planner checks the size limits before anything per layer: 10**8 layers are
    refused, or planned, in well under a second (strides built per layer take minutes)."""
    import time
    t0 = time.perf_counter()
    r = _run_module("layout", "--layers", "100000000", timeout=60)
    assert r.returncode == 2 and "its word view can address" in r.stderr, r.stderr
    r = _run_module("layout", "--layers", "100000000", "--num-blocks", "2", "--block-size", "64", "--json",
                    timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["num_layers"] == 10**8, r.stderr
    assert time.perf_counter() - t0 < 30


def test_bad_input_in_a_subprocess_has_no_traceback():
    r = _run_module("layout", "--block-size", "1000")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "error: block_size (1000)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_help_lists_every_registered_command(capsys):
    assert main(["-h"]) == 0
    out = capsys.readouterr().out
    for name, cmd in COMMANDS.items():
        assert name in out and cmd.summary in out
    assert main(["layout", "-h"]) == 0 and "--attn-block-bytes" in capsys.readouterr().out


def test_registry_entries_are_plain_argv_functions(monkeypatch, capsys):
    """A new command is one dict entry whose main takes the remaining argv."""
    from glm5_jax import __main__ as cli
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "echo", cli.Command("test only", lambda argv: seen.append(argv) or 3))
    assert main(["echo", "--x", "1", "-h"]) == 3
    assert seen == [["--x", "1", "-h"]]


# ---- demo ------------------------------------------------------------------------
def _demo_counts(out: str):
    return [int(m.group(1).replace(",", "")) for m in re.finditer(r"\)\s+([\d,]+) of [\d,]+ B changed", out)]


def test_demo_pallas_touches_only_owned_blocks(capsys, rng):
    seed = int(rng.integers(0, 2**31))
    assert main(["demo", "--implementation", "pallas", "--seed", str(seed)]) == 0, f"seed {seed}"
    out = capsys.readouterr().out
    assert re.search(r"^0 bytes changed outside the requests' blocks", out, re.M), out
    assert "golden check passed" in out
    assert len(re.findall(r"^request \d+:", out, re.M)) == 3
    counts = _demo_counts(out)
    # every tail block and every indexer block that holds a complete pool was written
    # (a request of 129..131 tokens owns a second indexer block with no complete pool yet)
    pools_per_block = 128 // 4
    reqs = list(re.finditer(r"^request \d+: \d+ tokens = (\d+) complete pools.*?\n((?:  .*\n)+)", out, re.M))
    assert len(reqs) == 3, out
    for m in reqs:
        pools, lines = int(m.group(1)), m.group(2)
        idx = [int(x.replace(",", "")) for x in re.findall(r"indexer block.*?\)\s+([\d,]+) of", lines)]
        tail = [int(x.replace(",", "")) for x in re.findall(r"tail block.*?\)\s+([\d,]+) of", lines)]
        full = -(-pools // pools_per_block)
        assert len(tail) == 1 and tail[0] > 0, out
        assert all(n > 0 for n in idx[:full]), out
    assert len(counts) >= 6, out


def test_demo_catches_the_dense_tail_stride_fault(capsys, rng):
    seed = int(rng.integers(0, 2**31))
    assert main(["demo", "--implementation", "xla", "--seed", str(seed),
                 "--fault", "dense-tail-stride"]) == 1, f"seed {seed}"
    cap = capsys.readouterr()
    assert "fault injected: dense-tail-stride" in cap.out
    # the tail rows land at block * 2,048 B instead of block * 4,224 B: the golden check sees it
    assert "golden check FAILED" in cap.err and "golden check passed" not in cap.out
