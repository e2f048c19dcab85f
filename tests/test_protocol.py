"""Control messages round-trip through msgpack; unknown or malformed frames are rejected
with a message saying why, and logged by decode_or_log; pickle never appears."""

from __future__ import annotations

import logging
import pickle

import msgspec
import pytest

from kvflow.connector import messages
from kvflow.connector.messages import KVData
from kvflow.serve import protocol
from kvflow.serve.protocol import (Allocate, ProtocolError, Register, Tokens, decode, decode_or_log,
                                   encode)


def test_every_message_round_trips():
    msgs = [Allocate(req_id="r1", token_ids=[256, 72, 105], max_tokens=4, temperature=0.5, seed=3),
            Tokens(req_id="r1", token_ids=[7], finished=True, finish_reason="length",
                   kvflow={"blocks": 2, "payload_bytes": 65536}),
            KVData(req_id="r1", num_blocks=2, num_frames=4, first_token=9, num_prompt_tokens=20,
                   t_start=1.5),
            Register(instance_id="p-1-ab", role="prefill", spec={"block_size": 16}, num_blocks=8,
                     free_blocks=8, max_model_len=512, kv_connector="ipc-pull", pid=1, shm_name="x",
                     host_id="b00t/4026531836")]
    for m in msgs:
        assert decode(encode(m)) == m
    assert msgspec.msgpack.decode(encode(msgs[0]))["type"] == "allocate"


@pytest.mark.parametrize("frame, why", [
    (b"\xc1", "not msgpack"),
    (pickle.dumps({"type": "allocate"}), "pickle"),
    (msgspec.msgpack.encode({"type": "launch_missiles"}), "Invalid value 'launch_missiles' - at `$.type`"),
    (msgspec.msgpack.encode({"type": "allocate", "req_id": "a"}), "Object missing required field `token_ids`"),
    (msgspec.msgpack.encode({"type": "allocate", "req_id": "a", "token_ids": "abc", "max_tokens": 1}),
     "Expected `array`, got `str` - at `$.token_ids`"),
    (msgspec.msgpack.encode({"type": "abort", "req_id": "a", "evil": 1}), "Object contains unknown field `evil`"),
    (msgspec.msgpack.encode([1, 2]), "Expected `object`, got `array`"),
])
def test_bad_frames_are_rejected(frame, why, caplog):
    with pytest.raises(ProtocolError, match="rejected control frame") as info:
        decode(frame)
    if why not in ("not msgpack", "pickle"):
        assert why in str(info.value)
    with caplog.at_level(logging.ERROR, logger="kvflow.serve.protocol"):
        assert decode_or_log(frame, "instance 'x'") is None
    assert "from instance 'x': rejected control frame" in caplog.text


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError, match="msg must be a kvflow.serve.protocol message, got dict"):
        encode({"type": "abort", "req_id": "a"})


def test_module_never_uses_pickle():
    for module in (protocol, messages):
        src = open(module.__file__).read()
        assert "import pickle" not in src and "pickle.loads" not in src
