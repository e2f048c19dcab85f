"""Failure kind 9 (control plane): the message decoder never crashes and never accepts a
malformed frame. Random bytes, mutated valid frames, wrong field types and unknown fields are
rejected with ProtocolError (and logged by decode_or_log); valid messages round-trip."""

from __future__ import annotations

import logging

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.serve import protocol
from kvflow.connector.messages import KVReady, LeaseRenew
from kvflow.serve.protocol import (MESSAGE_TYPES, Allocate, Allocated, Prefill, ProtocolError,
                                   decode, decode_or_log, encode)

VALID = [Allocate(req_id="r1", token_ids=[256, 1, 2], max_tokens=4),
         Allocated(req_id="r1", block_ids=[3, 4], num_cached_blocks=1),
         Prefill(req_id="r1", token_ids=[256, 7], decode_id="d-1", decode_block_ids=[3], num_cached_blocks=0),
         KVReady(req_id="r1", src_block_ids=[5, -1], first_token=9, num_prompt_tokens=17, t_start=1.5),
         LeaseRenew(req_ids=["r1", "r2"])]
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_safely(frame):
    """decode() either returns a known message or raises ProtocolError: nothing else."""
    try:
        msg = decode(frame)
    except ProtocolError:
        return None
    assert isinstance(msg, MESSAGE_TYPES)
    assert decode(encode(msg)) == msg  # anything accepted is a well-formed message
    return msg


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_never_crash(frame):
    _decode_safely(frame)


@FAST
@given(st.sampled_from(VALID), st.data())
def test_mutated_valid_frames_never_crash(msg, data):
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    _decode_safely(bytes(raw))


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
                           | st.text(max_size=8), lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)


@FAST
@given(st.sampled_from(VALID), st.data())
def test_wrong_types_and_unknown_fields_rejected(msg, data):
    d = msgspec.to_builtins(msg)
    field = data.draw(st.sampled_from(sorted(k for k in d if k != "type") + ["no_such_field"]))
    d[field] = data.draw(json_values)
    frame = msgspec.msgpack.encode(d)
    got = _decode_safely(frame)
    if field == "no_such_field":
        assert got is None
    elif got is not None:  # accepted only if the value is valid for the field's type
        sent = d[field]
        if isinstance(getattr(got, field), float) and isinstance(sent, int) \
                and not isinstance(sent, bool):
            sent = float(sent)  # an int is a valid float; above 2**53 it rounds, as in JSON
        assert getattr(got, field) == sent


@pytest.mark.parametrize("frame, words", [
    (msgspec.msgpack.encode({"type": "launchmissiles", "req_id": "x"}), "Invalid value 'launchmissiles'"),
    (msgspec.msgpack.encode({"type": "allocate", "req_id": "x", "token_ids": [1], "max_tokens": 0}),
     "Expected `int` >= 1 - at `$.max_tokens`"),
    (msgspec.msgpack.encode({"type": "allocated", "req_id": "x", "block_ids": [-3]}),
     "Expected `int` >= 0 - at `$.block_ids[0]`"),
    (msgspec.msgpack.encode({"type": "abort", "req_id": "x", "evil": 1}), "Object contains unknown field `evil`"),
    (msgspec.msgpack.encode({"type": "allocate", "req_id": 5, "token_ids": [1], "max_tokens": 1}),
     "Expected `str`, got `int` - at `$.req_id`"),
    (b"\xc1", "rejected control frame (1 bytes)"),
])
def test_rejections_say_why_and_are_logged(frame, words, caplog):
    with pytest.raises(ProtocolError, match=None) as info:
        decode(frame)
    assert words in str(info.value)
    with caplog.at_level(logging.ERROR, "kvflow.serve.protocol"):
        assert decode_or_log(frame, "fuzzer") is None
    assert "from fuzzer: rejected control frame" in caplog.text


@pytest.mark.parametrize("frame", [None, 12, "text", object()])
def test_non_bytes_frames_are_rejected(frame):
    with pytest.raises(ProtocolError, match="rejected control frame"):
        decode(frame)


def test_no_pickle_anywhere_in_the_package():
    import pathlib
    root = pathlib.Path(protocol.__file__).parents[1]  # kvflow/
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if any(w in line for w in ("import pickle", "from pickle", "cPickle", "import dill",
                                       "pickle.loads", "torch.load(", "allow_pickle=True"))]
    assert hits == []
