"""kvflow.wire: the one codec under serve's protocol and the vLLM connector's messages. Each
family decodes its own messages only; a frame of the other family is refused by name."""

import logging

import pytest

from kvflow.connector import messages as data_messages
from kvflow.serve import protocol
from kvflow.integrations.vllm import messages as vllm_messages
from kvflow.wire import Codec, ProtocolError, WireMsg


class Ping(WireMsg):
    seq: int


def test_both_families_are_wire_messages_and_round_trip():
    ack = data_messages.KVAck(req_id="r1", ok=True)
    pull = vllm_messages.Pull(req_id="r1", block_ids=[3, 4], spec={})
    assert isinstance(ack, WireMsg) and isinstance(pull, WireMsg)
    assert protocol.decode(protocol.encode(ack)) == ack
    assert vllm_messages.decode(vllm_messages.encode(pull)) == pull


def test_a_frame_of_the_other_family_is_refused_naming_the_family():
    frame = protocol.encode(data_messages.KVAck(req_id="r1", ok=True))
    with pytest.raises(ProtocolError, match=r"^not a kvflow vLLM-connector message "
                                            rf"\({len(frame)} bytes\): Invalid value 'kvack'"):
        vllm_messages.decode(frame)
    pull = vllm_messages.encode(vllm_messages.Release(req_id="r1"))
    with pytest.raises(ProtocolError, match=rf"^rejected control frame \({len(pull)} bytes\): "
                                            r"Invalid value 'release'"):
        protocol.decode(pull)


def test_a_codec_encodes_its_types_only_and_logs_rejections_to_its_logger(caplog):
    codec = Codec((Ping,), what="ping", reject="not a ping", logger="kvflow.test_wire")
    assert codec.decode(codec.encode(Ping(seq=7))) == Ping(seq=7)
    with pytest.raises(TypeError, match="^msg must be a ping message, got KVAck$"):
        codec.encode(data_messages.KVAck(req_id="r1", ok=True))
    with caplog.at_level(logging.ERROR, logger="kvflow.test_wire"):
        assert codec.decode_or_log(b"\xc1", "peer 'x'") is None
    assert caplog.records[-1].name == "kvflow.test_wire"
    assert caplog.records[-1].getMessage().startswith("from peer 'x': not a ping (1 bytes): ")
    with pytest.raises(ProtocolError, match="^not a ping of type int: "):
        codec.decode(5)
