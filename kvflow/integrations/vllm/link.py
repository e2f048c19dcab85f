""":class:`Puller`, the base of D's end of every transport, with D's side channel to the P's it
pulls from: one ZMQ DEALER per P address, used from D's loader thread only."""

from __future__ import annotations

from typing import Any

import torch
import zmq

from .messages import PullReply, Release, decode, encode


class PullError(RuntimeError):
    """A pull that did not put the KV into D's blocks."""


class PeerTimeout(PullError):
    """P did not answer within the timeout."""


class Puller:
    """D's end of a transport over D's ``cache``, from D's loader thread. ``timeout_s``: longest
    wait for an answer of P or a NIXL READ (seconds, > 0; then :class:`PeerTimeout`, socket
    dropped); ``corrupt``: test hook, noise instead of the KV."""

    def __init__(self, cache: Any, *, timeout_s: float = 30.0, corrupt: bool = False) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.cache, self.timeout_s, self.corrupt = cache, timeout_s, corrupt
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}

    def _sock(self, addr: str) -> zmq.Socket:
        if (s := self._socks.get(addr)) is None:
            s = self._socks[addr] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
        return s

    def ask(self, addr: str, msg: Any, answer: type, what: str,
            req_id: str | None = None) -> tuple[Any, list[Any]]:
        """Send ``msg``; P's answer of type ``answer`` (of ``req_id`` when given: late answers
        are skipped) and the raw frames after it. :class:`PeerTimeout` names ``what``."""
        sock = self._sock(addr)
        sock.send(encode(msg))
        while True:
            if not sock.poll(int(self.timeout_s * 1000)):
                self.drop(addr)
                raise PeerTimeout(f"{what}: no answer from P at {addr} within "
                                  f"{self.timeout_s} s")
            header, *frames = sock.recv_multipart(copy=False)
            reply = decode(header)
            if isinstance(reply, answer) and (req_id is None or reply.req_id == req_id):
                return reply, frames

    def drop(self, addr: str) -> None:
        """Close the socket to ``addr``; the next use reconnects."""
        if (s := self._socks.pop(addr, None)) is not None:
            s.close(linger=0)

    def release(self, addr: str, req_id: str) -> None:
        """Tell P at ``addr`` to free ``req_id``'s blocks."""
        self._sock(addr).send(encode(Release(req_id)))

    def pull(self, addr: str, req_id: str, remote_ids: list[int], local_ids: list[int]) -> int:
        """Copy P's blocks ``remote_ids`` into D's ``local_ids`` (same length, logical order);
        returns the bytes written. :class:`PullError`: different lengths, P refused, no answer
        within ``timeout_s``, or the transport failed."""
        if len(remote_ids) != len(local_ids):
            raise PullError(f"request {req_id}: {len(remote_ids)} remote blocks for "
                            f"{len(local_ids)} local blocks")
        self._pull(addr, req_id, list(remote_ids), list(local_ids))
        if self.corrupt:
            ids = torch.tensor(local_ids, dtype=torch.int64)
            for t in self.cache.tensors():
                t[ids] = torch.randn(t[ids].shape).to(t.device, t.dtype)
        return len(local_ids) * self.cache.spec.bytes_per_block

    def _pull(self, addr: str, req_id: str, remote_ids: list[int], local_ids: list[int]) -> None:
        raise NotImplementedError

    def _ask_pull(self, addr: str, msg: Any) -> tuple[Any, list[Any]]:
        reply, frames = self.ask(addr, msg, PullReply, f"request {msg.req_id}", msg.req_id)
        if not reply.ok:
            raise PullError(f"request {msg.req_id}: P refused the pull: {reply.error}")
        return reply, frames

    def close(self) -> None:
        for addr in list(self._socks):
            self.drop(addr)
