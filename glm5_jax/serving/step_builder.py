"""A planned step as device arrays: every shard's step arrays packed into one int32
array per device.

``build_step`` (``step_metadata``) gives each shard's static-shape arrays; this adds
``dec_token_src`` (the previous step's flat row of each decode row's input token,
-1 where the token is in ``dec_token_ids``) and packs the fields of shard d, raveled
in name order, into row d of ONE array [D, total]: one host-to-device copy per
device and step instead of one per field. The jitted step unpacks its row with the
static field list (``unpack_step_arrays``).
"""
from __future__ import annotations

import numpy as np

from .step_metadata import StepShape, build_step


def pack_step_arrays(per_shard: list) -> tuple:
    """Every shard's step arrays (``StepArrays.as_dict()``, all int32) as ONE int32 array
    [D, total] (the fields of shard d raveled one after another, in name order) and
    the static field list ((name, shape), ...) that unpacks it."""
    names = sorted(per_shard[0])
    fields = tuple((k, tuple(per_shard[0][k].shape)) for k in names)
    for d in per_shard:
        for k, shape in fields:
            if d[k].dtype != np.int32 or tuple(d[k].shape) != shape:
                raise ValueError(f"step array {k}: every shard needs int32 {shape}, got {d[k].dtype} "
                                 f"{tuple(d[k].shape)}")
    return np.stack([np.concatenate([d[k].ravel() for k in names]) for d in per_shard]), fields


def unpack_step_arrays(flat, fields) -> dict:
    """Inverse of pack_step_arrays for one device's row: flat [total] -> {name: array}."""
    out, at = {}, 0
    for name, shape in fields:
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = flat[at:at + n].reshape(shape)
        at += n
    return out


def shard_step_arrays(config, shape: StepShape, plan) -> dict:
    """One shard's step arrays (``ShardPlan`` -> {name: int32 array}), dec_token_src included."""
    arrays = build_step(config, shape, plan.dec_rows, plan.pre_rows).as_dict()
    src = np.full((shape.decode_rows, shape.decode_width_tokens), -1, np.int32)
    src[:len(plan.dec_src), 0] = plan.dec_src
    arrays["dec_token_src"] = src
    return arrays
