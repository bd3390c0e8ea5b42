"""Command line entry points: ``python -m glm5_jax <command> ...`` (console script ``glm5-jax``).

Commands:
  layout   the memory plan of a cache layout (sizes per block, per layer, what fits)
  demo     a short prefill + decode through ``glm5_jax.ops`` on a sentinel-filled
           cache, with a per-request account of which bytes changed

Each command is one entry of ``COMMANDS``: a one-line summary and a function
``main(argv: list[str]) -> int`` that parses its own arguments. A command that
lives in its own module is registered with ``_delegate``, which imports the
module only when the command runs, e.g.::

    "simulate": Command("serve a scripted workload end to end", _delegate("glm5_jax.simulate")),

Exit codes: 0 success, 1 a check failed, 2 bad arguments (an argparse error or
the library's ValueError, printed as one line, never a traceback).

Importing this module does not import jax: ``layout`` answers instantly.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from typing import Callable

from .layout import FAULTS, with_fault          # numpy only: importing the package never imports jax


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "glm5-jax" if name == "glm5-jax" else "python -m glm5_jax"


class _UsageError(Exception):
    """Bad input found after argument parsing (e.g. the library's ValueError)."""


def int_at_least(lowest: int):
    """argparse type: an integer >= lowest, with a one-line error otherwise."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {v}")
        return v
    return parse


_nonneg_int = int_at_least(0)


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"{_prog()} {command}", description=description)


def _build_layout(args, *, num_layers, num_blocks, attn_block_bytes):
    """IndexerConfig + CacheLayout from CLI numbers; the library's ValueError becomes a usage error."""
    from .config import IndexerConfig
    from .layout import CacheLayout
    try:
        config = IndexerConfig(block_size=args.block_size, kpool=args.kpool,
                               num_spec_tokens=args.spec_tokens)
        return CacheLayout(config, num_layers=num_layers, num_blocks=num_blocks,
                           attn_block_bytes=attn_block_bytes)
    except ValueError as e:
        raise _UsageError(str(e)) from None


def _add_geometry_args(p, *, block_size: int):
    p.add_argument("--block-size", type=_nonneg_int, default=block_size, metavar="N",
                   help=f"tokens per manager block (default {block_size})")
    p.add_argument("--kpool", type=_nonneg_int, default=4, metavar="N",
                   help="tokens per pool (default 4)")
    p.add_argument("--spec-tokens", type=_nonneg_int, default=0, metavar="N",
                   help="speculative tokens per step; sets the tail ring size (default 0)")


# ---------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def layout_main(argv: list[str]) -> int:
    p = _parser("layout", "Print the memory plan of one flat cache: per block, per layer, in total.")
    _add_geometry_args(p, block_size=1152)
    p.add_argument("--num-blocks", type=_nonneg_int, default=800, metavar="N",
                   help="block ids per layer, including the null block 0 (default 800)")
    p.add_argument("--layers", type=_nonneg_int, default=11, metavar="N",
                   help="indexer layers in the buffer (default 11, GLM-5.3-Flash)")
    p.add_argument("--attn-block-bytes", type=_nonneg_int, default=0, metavar="N",
                   help="attention bytes per block per layer, 0 = no attention region (default 0)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    args = p.parse_args(argv)
    lay = _build_layout(args, num_layers=args.layers, num_blocks=args.num_blocks,
                        attn_block_bytes=args.attn_block_bytes)
    if args.json:
        print(json.dumps(lay.summary(), indent=2))
        return 0
    c = lay.config
    print(f"Cache layout: {lay.num_layers} layer(s) x {lay.num_blocks} blocks of {c.block_size} tokens "
          f"(kpool {c.kpool}, ring {c.ring}, {c.pages_per_block} page(s) of {c.page_rows} pool rows per block)")
    print()
    print(lay.table())
    print()
    print(f"total: {lay.total_bytes:,} B = {_gib(lay.total_bytes)}; indexer blocks are "
          f"{c.index_block_bytes:,} B each; a request's tail ring ({c.tail_block_bytes:,} B) aliases "
          f"the start of one whole block")
    return 0


# ---------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------
SENTINEL = 0xA5
DEMO_LAYERS, DEMO_LAYER, DEMO_BLOCKS, DEMO_ATTN_BLOCK_BYTES = 2, 1, 12, 1024
MAX_DECODE_STEPS = 32
MAX_DEMO_TOKENS = 320                     # per request


def _count_changed(raw, start: int, end: int) -> int:
    return int((raw[start:end] != SENTINEL).sum())


def _locate(lay, byte_offsets) -> dict:
    """{region name: changed bytes} for stray byte offsets, by the layout's own block ranges."""
    import numpy as np
    out, left = {}, np.asarray(byte_offsets)
    for layer in range(lay.num_layers):
        for b in range(lay.num_blocks):
            a, e = lay.block_byte_range(layer, b)
            n = int(((left >= a) & (left < e)).sum())
            if n:
                out[f"layer {layer} indexer block {b}" + (" (the null block)" if b == 0 else "")] = n
    idx_start = lay.index_base_bytes(0)
    n_attn = int((left < idx_start).sum())
    n_pad = int((left >= lay.index_base_bytes(lay.num_layers - 1) + lay.index_region_bytes).sum())
    if n_attn:
        out["the attention region"] = n_attn
    if n_pad:
        out["the padding after the last layer"] = n_pad
    return out


def demo_main(argv: list[str]) -> int:
    p = _parser("demo", "Prefill + a few decode steps for 3 requests on a sentinel-filled cache, "
                        "then show which bytes each request changed and check that nothing else did.")
    p.add_argument("--implementation", choices=("xla", "pallas"), default=None,
                   help="xla = golden reference, pallas = Pallas kernels (interpret mode on CPU); "
                        "default: pallas on GPU, xla elsewhere")
    p.add_argument("--seed", type=_nonneg_int, default=0, metavar="N",
                   help="random seed for request lengths, block placement and K/gate rows (default 0)")
    p.add_argument("--decode-steps", type=_nonneg_int, default=5, metavar="N",
                   help="decode steps of one token per request (default 5)")
    p.add_argument("--fault", choices=FAULTS, default=None,
                   help="inject a historical bug on purpose to watch the check catch it "
                        "(dense-tail-stride = docs/semantics.md B1); the demo then exits 1")
    _add_geometry_args(p, block_size=128)
    args = p.parse_args(argv)
    if not 1 <= args.decode_steps <= MAX_DECODE_STEPS:
        p.error(f"--decode-steps must be in [1, {MAX_DECODE_STEPS}], got {args.decode_steps}")
    lay = _build_layout(args, num_layers=DEMO_LAYERS, num_blocks=DEMO_BLOCKS,
                        attn_block_bytes=DEMO_ATTN_BLOCK_BYTES)

    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import ops
    from .testing import Scenario

    c, layer = lay.config, DEMO_LAYER
    impl = args.implementation or ops.default_implementation()
    rng = np.random.default_rng(args.seed)
    steps = args.decode_steps
    # Three requests of up to 2 blocks each (3 x 2 indexer blocks + 3 tail blocks fit in the
    # 11 usable blocks), at most MAX_DEMO_TOKENS tokens so interpret mode stays quick.
    hi = max(2, min(2 * c.block_size, MAX_DEMO_TOKENS) - steps)
    prefill_tokens = [int(x) for x in rng.integers(max(1, hi // 3), hi + 1, size=3)]
    lengths = [n + steps for n in prefill_tokens]
    try:
        sc = Scenario.random(rng, lay, lengths, layer=layer)
    except ValueError as e:
        raise _UsageError(str(e)) from None

    print(f"demo: implementation={impl} on {jax.default_backend()}, seed {args.seed}; "
          f"block_size {c.block_size} tokens, kpool {c.kpool}, ring {c.ring}, "
          f"{lay.num_layers} layers x {lay.num_blocks} blocks, writing layer {layer}")
    print(f"cache: {lay.total_bytes:,} B, every byte = 0x{SENTINEL:02X}")

    if args.fault:
        print(f"fault injected: {args.fault} (every op addresses tail blocks with the dense stride "
              f"{c.tail_block_bytes:,} B instead of the padded {c.index_block_bytes:,} B)")

    def jitted(op):
        return jax.jit(functools.partial(op, implementation=impl), static_argnums=(1, 2), donate_argnums=0)
    ops_layout = with_fault(lay, args.fault)       # the ops address the cache through its strides

    compress, seed, decode = jitted(ops.compress_prefill), jitted(ops.seed_tail), jitted(ops.decode_update)
    cache = lay.allocate(SENTINEL)
    ape = jnp.asarray(sc.ape)
    pre = {k: jnp.asarray(v) for k, v in sc.prefill(prefill_tokens).items()}
    cache = compress(cache, ops_layout, layer, pre["key"], pre["gate"], ape, pre["slot_mapping"])
    cache = seed(cache, ops_layout, layer, pre["key"], pre["gate"], pre["tslot"])
    print(f"prefill: {sum(prefill_tokens)} tokens ({' + '.join(map(str, prefill_tokens))})")
    done = list(prefill_tokens)
    for _ in range(steps):
        st = {k: jnp.asarray(v) for k, v in sc.decode(done, [1] * len(done), width=1).items()}
        cache = decode(cache, ops_layout, layer, st["key"], st["gate"], ape, st["slot_mapping"],
                       st["tslot"], st["positions"])
        done = [d + 1 for d in done]
    print(f"decode: {steps} step(s) of 1 token per request")
    print()

    raw = np.asarray(cache).view(np.uint8)
    for i, r in enumerate(sc.requests):
        pools = done[i] // c.kpool
        print(f"request {i}: {done[i]} tokens = {pools} complete pools + {done[i] % c.kpool} in the tail ring")
        for b in r.index_blocks:
            a, e = lay.block_byte_range(layer, int(b))
            print(f"  indexer block {int(b):>3}: bytes [{a:>9,}, {e:>9,})  "
                  f"{_count_changed(raw, a, e):>6,} of {e - a:,} B changed")
        a, e = lay.block_byte_range(layer, r.tail_block)
        print(f"  tail block    {r.tail_block:>3}: bytes [{a:>9,}, {e:>9,})  "
              f"{_count_changed(raw, a, e):>6,} of {e - a:,} B changed "
              f"(the ring is the first {c.tail_block_bytes:,} B)")
    outside = sc.unowned_mask()
    n_outside = int((raw[outside] != SENTINEL).sum())
    print("  (counts are bytes that now differ from the sentinel: a written byte equal to "
          f"0x{SENTINEL:02X} is not counted)")
    print()
    print(f"{n_outside} bytes changed outside the requests' blocks "
          f"({int(outside.sum()):,} bytes checked: other blocks, other layer, attention region, padding)")
    if n_outside:
        for where, n in _locate(lay, np.nonzero(outside & (raw != SENTINEL))[0]).items():
            print(f"  {n:>6,} B in {where}")
    try:
        summary = sc.check_cache(cache, done, SENTINEL)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).splitlines()
                 if ln.strip() and ln.strip() != "Arrays are not equal"][:2]
        sys.stdout.flush()
        print(f"golden check FAILED: {'; '.join(lines)}", file=sys.stderr)
        return 1
    print(f"golden check passed: {summary['pools']} pools and every tail ring match the "
          f"paging-free golden model byte for byte")
    return 0 if n_outside == 0 else 1


# ---------------------------------------------------------------------------------
# registry and dispatch
# ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Command:
    summary: str
    main: Callable[[list], int]


def _delegate(module: str) -> Callable[[list], int]:
    """A command implemented as ``<module>.main(argv)``, imported only when it runs."""
    def run(argv: list) -> int:
        return importlib.import_module(module).main(argv)
    return run


COMMANDS: dict[str, Command] = {
    "layout": Command("print the memory plan of a cache layout", layout_main),
    "demo": Command("prefill + decode a few requests and account for every changed byte", demo_main),
    "simulate": Command("serve the cached-prompt churn workload (docs/semantics.md 6.1) and probe the "
                        "prompt's pages", _delegate("glm5_jax.simulate")),
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (0 ok, 1 check failed, 2 bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    epilog = "commands:\n" + "\n".join(f"  {n:<10} {c.summary}" for n, c in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=_prog(), formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog,
        description="glm5-jax: the GLM-5.3-Flash kpool indexer cache in JAX + Pallas. "
                    f"Run '{_prog()} COMMAND -h' for a command's options.")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND",
                        help="a command from the list below")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    try:
        if not argv:
            parser.error(f"a COMMAND is required (one of: {', '.join(COMMANDS)})")
        ns = parser.parse_args(argv)
        return int(COMMANDS[ns.command].main(ns.args) or 0)
    except BrokenPipeError:                      # e.g. `... layout | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except SystemExit as e:                      # argparse: -h (0) or a usage error (2)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)           # sys.exit("message") from a command
        return 1
    except _UsageError as e:
        print(f"{_prog()} {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
