"""The connector interface: how a request's KV blocks get from P's paged cache into D's.

A transfer has two halves, both driven by the instances' event loops over one ZMQ link
(P's DEALER connected to D's ROUTER data socket):

- :class:`KVSender` (on P) turns "request ``req_id`` has its prompt KV in my blocks
  ``src_ids``" into frames for D (:meth:`KVSender.send`), and says whether P's blocks must stay
  allocated until D acknowledges (:attr:`KVSender.holds_blocks`).
- :class:`KVReceiver` (on D) meets P once (:meth:`KVReceiver.attach`, at pairing) and turns
  those frames into blocks of its own cache at the block ids D allocated
  (:meth:`KVReceiver.receive`), returning the payload bytes actually moved.

Layerwise transfer (:mod:`kvflow.transfer.layerwise` on P, :mod:`kvflow.transfer.parts` on D)
sends a request as several :class:`~kvflow.protocol.KVLayer` parts
(:meth:`KVSender.send_part`); :meth:`KVReceiver.receive` returns None until the last one.

D always writes into the block table it allocated itself; P's ids only name where to read.
Sends are refused while a dummy/profile run is in progress (:func:`kvflow.context.sends_allowed`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed


class TransferError(RuntimeError):
    """A transfer that cannot be done (bad frames, unmapped peer, size mismatch)."""


@dataclasses.dataclass
class TransferStats:
    """What one request's transfer moved: blocks, payload bytes, and D-side copy time (ms)."""
    blocks: int
    payload_bytes: int
    copy_ms: float


def check_send_allowed(what: str) -> None:
    """Raise if called during a dummy/profile run (nothing may be sent then)."""
    if not sends_allowed():
        raise RuntimeError(f"{what} during a dummy/profile run: nothing may be sent "
                           f"while is_dummy_or_profile_run is set")


def as_ids(ids: Any) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor."""
    return torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids,
                           dtype=torch.int64).reshape(-1)


class KVSender(abc.ABC):
    """P's half of a transfer."""

    name: str = ""
    #: True when P's blocks are read by D after :meth:`send` returns (free them on D's ack).
    holds_blocks: bool = True

    @abc.abstractmethod
    def send(self, link: Any, req_id: str, cache: PagedKVCache, src_ids: list[int], *,
             first_token: int, num_prompt_tokens: int) -> Any:
        """Send the request's KV (or a pointer to it) over ``link`` (a zmq socket).

        Returns an object P must keep alive until D's :class:`~kvflow.protocol.KVAck`
        (e.g. a staging buffer whose memory ZMQ sends zero-copy), or None.
        """

    def send_part(self, link: Any, cache: PagedKVCache, src_ids: list[int], layers: range,
                  **fields: Any) -> tuple[Any, float]:
        """Send one layerwise part: layers ``layers`` of P's blocks ``src_ids`` as a
        :class:`~kvflow.protocol.KVLayer` (``fields`` fill the header: ``req_id``,
        ``reply_to``, ``block_offset``...). Returns ``(keep, gather_ms)``: an object to keep
        alive until D's ack (or None) and P's gather time in ms (0 when nothing is gathered).

        Raises
        ------
        RuntimeError
            Inside a dummy/profile run.
        """
        raise NotImplementedError(f"{type(self).__name__} has no layerwise path")

    def export(self) -> dict[str, str]:
        """Fields for P's Register message (e.g. ``shm_name``)."""
        return {}

    def close(self) -> None:
        """Release resources (shared memory, staging buffers)."""


class KVReceiver(abc.ABC):
    """D's half of a transfer."""

    name: str = ""

    def attach(self, peer_id: str, peer_spec: Any, peer_num_blocks: int, shm_name: str = "") -> None:
        """Meet P (at pairing): map its cache if the transfer reads it directly."""

    def detach(self, peer_id: str) -> None:
        """Forget P ``peer_id`` (it died): drop its mapping, if the transfer keeps one."""

    @abc.abstractmethod
    def receive(self, header: Any, frames: list[Any], cache: PagedKVCache,
                dst_ids: list[int], peer_id: str | None = None) -> TransferStats:
        """Put the request's KV described by ``header`` (+ raw ``frames``) into ``cache`` at
        ``dst_ids`` (D's own block ids, one per prompt block). ``peer_id``: the P that sent it
        (a D paired with several P's reads the sender's cache; None: the last paired one).

        Raises
        ------
        TransferError
            For frames that do not match the header or the spec, or an unattached peer.
        """

    def forget(self, req_id: str) -> None:
        """Drop the state of a partly received layerwise transfer (D ended the request)."""
        parts = getattr(self, "parts", None)
        if parts is not None:
            parts.forget(req_id)

    def close(self) -> None:
        """Unmap the peer."""
