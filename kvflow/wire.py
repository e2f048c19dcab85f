"""The one wire codec of kvflow: typed messages as MessagePack, never pickle.

Every message family (serve's control plane, :mod:`kvflow.serve.protocol`; the connectors'
data plane, :mod:`kvflow.connector.messages`; the vLLM connector's pull protocol,
:mod:`kvflow.integrations.vllm.messages`) subclasses :class:`WireMsg` and builds one
:class:`Codec` over the union of its classes. A frame is decoded against that union only: an
unknown tag, a missing or extra field, a wrong type or bytes that are not msgpack raise
:class:`ProtocolError` naming the family and the fault, so a peer's frame is either a known,
well-formed message or it is logged and dropped, never executed.

Messages are :class:`msgspec.Struct` tagged by their lower-cased class name (field ``type`` on
the wire) with ``forbid_unknown_fields``. Bulk KV bytes never go through a codec: they travel as
raw frames after a header message.
"""

from __future__ import annotations

import logging
from typing import Any, Union

import msgspec


class ProtocolError(ValueError):
    """A frame that is not a known, well-formed kvflow message of the family decoding it."""


class WireMsg(msgspec.Struct, tag_field="type", tag=str.lower, forbid_unknown_fields=True):
    """Base of every kvflow wire message (tag: the lower-cased class name)."""


def frame_nbytes(frame: Any) -> int:
    """Bytes of ``frame`` (bytes, memoryview, zmq.Frame), or -1 when it is not bytes-like."""
    try:
        return memoryview(getattr(frame, "buffer", frame)).nbytes
    except TypeError:
        return -1


class Codec:
    """Encoder and decoder of one message family.

    Parameters
    ----------
    types : tuple of WireMsg subclasses
        The family's messages (their tags must differ).
    what : str
        The family's name in errors, e.g. ``"kvflow.serve.protocol"`` or ``"control frame"``.
    reject : str
        The start of a rejection message: ``"{reject} ({n} bytes): {fault}"``.
    logger : str
        The logger :meth:`decode_or_log` writes rejections to (the family's module).
    """

    def __init__(self, types: tuple[type, ...], *, what: str, reject: str,
                 logger: str = "kvflow.wire") -> None:
        self.types, self.what, self.reject = tuple(types), what, reject
        self.log = logging.getLogger(logger)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Union[self.types])  # type: ignore[valid-type]

    def encode(self, msg: Any) -> bytes:
        """One msgpack frame of ``msg``.

        Raises
        ------
        TypeError
            ``msg`` is not one of :attr:`types`.
        """
        if not isinstance(msg, self.types):
            raise TypeError(f"msg must be a {self.what} message, got {type(msg).__name__}")
        return self._encoder.encode(msg)

    def decode(self, frame: Any) -> Any:
        """The message in one frame (bytes, memoryview or zmq.Frame).

        Raises
        ------
        ProtocolError
            An unknown message type, a missing/extra field, a wrong field type, bytes that are
            not msgpack, or a frame that is not bytes-like; the message says which.
        """
        buf = getattr(frame, "buffer", frame)
        try:
            return self._decoder.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"{self.reject} ({frame_nbytes(buf)} bytes): {exc}") from None
        except (TypeError, ValueError, RecursionError) as exc:  # not a bytes-like frame at all
            raise ProtocolError(f"{self.reject} of type {type(buf).__name__}: {exc}") from None

    def decode_or_log(self, frame: Any, source: str = "?") -> Any | None:
        """:meth:`decode`, but log a rejected frame (naming ``source``) and return None."""
        try:
            return self.decode(frame)
        except ProtocolError as exc:
            self.log.error("from %s: %s", source, exc)
            return None
