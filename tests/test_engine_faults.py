"""Engine failure semantics (docs/engine_failures.md): one exception injected at each
phase of a step, synchronous and with two steps in flight, never yields a wrong
token and never wedges the engine; requests and arguments the engine cannot serve
are refused where they are given, not at the first step.

Fault injection: a phase's internal function is patched to raise once, at a call
in the middle of a workload that admits, prefills in chunks, decodes, hits the
prefix cache and records selections. After the exception every request either
finishes with the tokens of a clean run, or ends with status "failed" holding a
prefix of them (the phases after the step reached the devices fail the requests of
that step, and only those); the engine serves a request added afterwards like a
clean engine; the BlockPool invariants hold and no block is held at the end.

Compile budget: every engine here has the same model structure, layout and bucket
minimums, so all of them share ONE compiled step (and one compiled row gather).
"""
import numpy as np
import pytest

from glm5_jax.config import IndexerConfig
from glm5_jax.layout import with_fault
from glm5_jax.model.decoder import Decoder, ModelConfig
from glm5_jax.serving import admission, blocks, engine as eng_mod, recording
from glm5_jax.serving.commit import Committer
from glm5_jax.serving.engine import Engine, EngineStepError
from glm5_jax.serving.step_metadata import BucketMins

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=1, num_heads=2, head_dim=32, q_lora_rank=32,
                  mlp_size=64, indexer=IndexerConfig(n_heads=4, topk=64, block_size=64))
NB = 16
BS = CFG.indexer.block_size
MINS = BucketMins(decode_rows=2, prefill_rows=1, prefill_width_tokens=32, table_blocks=2)


class InjectedFault(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return Decoder.random(CFG, seed=3)


def make_engine(model, **kw):
    kw = dict(dict(max_running_requests=2, max_prefill_requests=1, prefill_chunk_tokens=32, bucket_mins=MINS,
                   record=lambda rid: rid == "r1"), **kw)
    return Engine(model, NB, **kw)


def workload():
    """Five requests, two running at a time: prompts of several chunks, one that hits
    the first one's cached block, new-token counts that finish them at different steps."""
    rng = np.random.default_rng(11)
    toks = lambda n: [int(t) for t in rng.integers(0, CFG.vocab_size, n)]    # noqa: E731
    first = toks(80)
    return [("r0", first, 5), ("r1", toks(40), 7), ("r2", toks(12), 3), ("r3", first[:BS] + toks(20), 4),
            ("r4", toks(70), 6)]


LATE = ("late", workload()[0][1], 5)         # r0's prompt again, after the fault


@pytest.fixture(scope="module")
def clean(model):
    """Every request's tokens from a clean synchronous run."""
    e = make_engine(model)
    for r in workload() + [LATE]:
        e.add_request(*r)
    outs = e.run()
    assert all(o.finished for o in outs.values())
    return {rid: o.output_tokens for rid, o in outs.items()}


def raise_on_call(monkeypatch, owner, name, call: int, *, after: bool = False):
    """Patch owner.name to raise InjectedFault on its call-th call (once): before the
    real call, or after it (`after`: its effects happened, its result is lost)."""
    real = getattr(owner, name)
    count = [0]

    def patched(*args, **kw):
        count[0] += 1
        if count[0] == call and not after:
            raise InjectedFault(f"{name} call {call}")
        out = real(*args, **kw)
        if count[0] == call:
            raise InjectedFault(f"{name} call {call} (after it ran)")
        return out
    monkeypatch.setattr(owner, name, patched)
    return count


# phase -> (where the fault goes, before/after the real call, whether requests may fail)
PHASES = {
    "plan": (lambda: (admission.Scheduler, "plan"), False, False),
    "batch": (lambda: (Engine, "_batch"), False, False),
    "dispatch": (lambda: (eng_mod, "_step"), False, False),
    "dispatch-consumed-cache": (lambda: (eng_mod, "_step"), True, True),
    "fetch_selected": (lambda: (recording.Recorder, "fetch_selected"), False, True),
    "fetch": (lambda: (eng_mod, "fetch_tokens"), False, True),
    "commit": (lambda: (Committer, "commit"), False, True),
    "commit-one-request": (lambda: (blocks.BlockPool, "commit"), False, True),
}


@pytest.mark.parametrize("in_flight", [0, 2])
@pytest.mark.parametrize("phase", list(PHASES))
def test_one_fault_never_gives_a_wrong_token(model, clean, monkeypatch, phase, in_flight):
    where, after, may_fail = PHASES[phase]
    owner, name = where()
    e = make_engine(model, async_scheduling=in_flight)
    for r in workload():
        e.add_request(*r)
    calls = raise_on_call(monkeypatch, owner, name, 6, after=after)
    raised = []
    for _ in range(200):
        if not e.has_unfinished():
            break
        try:
            e.step()
        except EngineStepError as err:
            assert isinstance(err.__cause__, InjectedFault), err
            raised.append(err)
    assert calls[0] >= 6 and len(raised) == 1, (calls[0], raised)
    err = raised[0]
    failed = check_outcomes(e, clean)
    assert sorted(err.failed) == failed, (err, failed)
    assert all("InjectedFault" in e.get_output(rid).error for rid in failed)
    if not may_fail:
        assert not failed, f"{phase}: nothing reached the devices, yet {failed} failed"
    else:
        assert failed, f"{phase}: the step's results were lost but no request failed"
        assert len(failed) < len(workload()), "every request failed"
    assert str(err).startswith(f"step {err.step}: {err.phase} raised")


def check_outcomes(e, clean) -> list:
    """Every request finished with the clean run's tokens or failed holding a prefix of
    them; a request added now is served like on a clean engine; no block is held.
    Returns the failed ids."""
    outs = e.outputs
    failed = sorted(rid for rid, o in outs.items() if o.status == "failed")
    for rid, o in outs.items():
        if o.status == "failed":
            assert o.error and o.output_tokens == clean[rid][:len(o.output_tokens)], rid
        else:
            assert o.finished and o.output_tokens == clean[rid], (rid, o.status)
    e.add_request(*LATE)
    e.run()
    assert e.get_output("late").finished and e.get_output("late").output_tokens == clean["late"]
    pool = e.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == NB - 1 and not pool.requests() and not e.has_unfinished()
    return failed


@pytest.mark.parametrize("in_flight", [0, 1])
def test_keyboard_interrupt_leaves_the_engine_consistent(model, clean, monkeypatch, in_flight):
    """A KeyboardInterrupt while waiting for a step's tokens propagates as itself; the
    step's requests fail, and the engine serves on."""
    e = make_engine(model, async_scheduling=in_flight)
    for r in workload():
        e.add_request(*r)
    real, calls = eng_mod.fetch_tokens, [0]

    def interrupted(launch):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return real(launch)
    monkeypatch.setattr(eng_mod, "fetch_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        e.run()
    e.run()
    assert check_outcomes(e, clean)


def test_abort_after_failure_keeps_the_failure(model, clean, monkeypatch):
    e = make_engine(model, async_scheduling=1)
    for r in workload()[:2]:
        e.add_request(*r)
    raise_on_call(monkeypatch, eng_mod, "fetch_tokens", 2)
    with pytest.raises(EngineStepError) as ei:
        e.run()
    assert ei.value.failed and ei.value.phase == "device_wait"
    rid = ei.value.failed[0]
    e.abort_request(rid)
    assert e.get_output(rid).status == "failed"
    e.run()
    e.block_pool.check_invariants()
    assert e.block_pool.num_free_blocks == NB - 1


# ---------------------------------------------------------------------------------
# what a step would fail on is refused where it is given
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, error, msg", [
    (dict(implementation="bogus"), ValueError, "implementation must be one of"),
    (dict(implementation="triton"), ValueError, "implementation must be one of"),   # not every op has it
    (dict(layout="dense-tail-stride"), ValueError, "layout must be the model's layout"),
    (dict(layout=CFG.layout(NB + 1)), ValueError, "layout must be the model's layout"),
    (dict(chunk_policy=32), ValueError, "chunk_policy must be callable"),
    (dict(draft_fn="lookup"), ValueError, "draft_fn must be callable"),
    (dict(record="yes"), ValueError, "record must be a bool or a predicate"),
    (dict(snapshot_on_finish=None), ValueError, "snapshot_on_finish must be a bool"),
    (dict(bucket_mins=(2, 1, 32, 2)), ValueError, "bucket_mins must be a BucketMins"),
    (dict(fault="dense-tail-stride"), TypeError, "fault"),        # the fault is a layout now
])
def test_bad_engine_arguments_fail_at_construction(model, kw, error, msg):
    with pytest.raises(error, match=msg):
        make_engine(model, **kw)


def test_fault_is_a_layout(model):
    with pytest.raises(ValueError, match="unknown fault 'bogus'"):
        with_fault(CFG.layout(NB), "bogus")
    faulty = with_fault(CFG.layout(NB), "dense-tail-stride")
    e = make_engine(model, layout=faulty, dry_run=True)
    assert e.layout == faulty and e.layout != CFG.layout(NB)
    assert not e.layout.strides(0).is_padded_tail_stride and CFG.layout(NB).strides(0).is_padded_tail_stride
    assert with_fault(faulty, None) == CFG.layout(NB)


def test_bad_requests_are_refused_at_add_request_and_the_rest_run(model, clean):
    e = make_engine(model)
    e.add_request(*workload()[2])
    bad = [
        (("str", "123", 3), "sequence of int token ids, got str"),
        (("bytes", b"\x01\x02", 3), "sequence of int token ids, got bytes"),
        (("none", None, 3), "sequence of int token ids"),
        (("float", [1.0, 2.0], 3), r"token 0 is 1\.0 \(float\)"),
        (("float-late", [1, 2.7], 3), r"token 1 is 2\.7"),
        (("bool", [True, 2], 3), "token 0 is True"),
        (("np-float", np.array([1.5, 2.0]), 3), "token ids must be ints"),
        (("str-token", [1, "2"], 3), "token ids must be ints"),
        (("vocab", [1, CFG.vocab_size], 3), "outside the vocabulary"),
        (("empty", [], 3), "empty prompt"),
        (("new-float", [1, 2], 2.0), "max_new_tokens"),
        (("new-bool", [1, 2], True), "max_new_tokens"),
        (("surrogate", [1, 2], 3, "tenant-\ud800"), "cannot be encoded as UTF-8"),
        (("empty-salt", [1, 2], 3, ""), "cache_salt must not be empty"),
        (("bytes-salt", [1, 2], 3, b"t"), "cache_salt must be a str or None"),
        (([1], [1, 2], 3), "not hashable"),
        (("r2", [1, 2], 3), "duplicate request id"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            e.add_request(*args)
    assert set(e.outputs) == {"r2"}
    e.add_request("r1", np.asarray(workload()[1][1], np.int64), np.int64(7))   # numpy ints are ints
    e.run()
    assert e.get_output("r2").output_tokens == clean["r2"] and e.get_output("r1").output_tokens == clean["r1"]
    e.block_pool.check_invariants()


def test_a_salt_never_shares_blocks_with_no_salt(model):
    """cache_salt is an isolation boundary: a salted request never hits unsalted blocks
    (nor the other way round), and the hash keeps "" apart from no salt too."""
    prompt = workload()[0][1]
    assert blocks.chain_hashes(prompt, BS, "") != blocks.chain_hashes(prompt, BS, None)
    assert blocks.chain_hashes(prompt, BS, "a") != blocks.chain_hashes(prompt, BS, None)
    e = make_engine(model, dry_run=True)
    e.add_request("plain", prompt, 2)
    e.run()
    e.add_request("salted", prompt, 2, cache_salt="tenant")
    e.add_request("plain-again", prompt, 2)
    e.run()
    assert e.get_output("salted").num_cached_tokens == 0
    assert e.get_output("plain-again").num_cached_tokens == BS
    e.add_request("salted-again", prompt, 2, cache_salt="tenant")
    e.run()
    assert e.get_output("salted-again").num_cached_tokens == BS
