"""The halves of ``ipc-pull`` and ``tcp``, whose KV (or a pointer to it) goes to D as messages on
the link: after the prefill in one message (:meth:`FramedSender.send`), or layer by layer
through :class:`~kvflow.connector.layerwise.LayerwiseSender` (:meth:`FramedSender.send_part`),
made only when some prompt can go layerwise (``layerwise_min_tokens <= max_model_len``).
"""

from __future__ import annotations

import abc
from typing import Any

from kvflow.context import sends_allowed

from .base import Kept, KVReceiver, KVSender, Peer, PrefillJob, Prefilling, TransferError
from .layerwise.parts import LayerParts
from .receiver import RECEIVE_MAX_CTAS


class FramedSender(KVSender):
    """Base of :class:`~kvflow.connector.ipc_pull.IpcPullSender` and
    :class:`~kvflow.connector.tcp.TcpSender`."""

    #: P's blocks are read by D after :meth:`send` returns (free them on D's ack).
    holds_blocks: bool = True
    #: A layer unsignalled this long fails the request (seconds).
    signal_timeout_s: float = 30.0
    #: ``--kv-verify``: send a digest of every block (:mod:`.verify`); set by the instance.
    verify: bool = False

    def __init__(self, spec, device: Any = "cpu", **kw: Any) -> None:
        super().__init__(spec, device, **kw)
        self.layerwise = None  # LayerwiseSender, when some prompt can go layerwise
        self.peer_specs: dict = {}  # attached D -> its KVCacheSpec

    @abc.abstractmethod
    def send(self, link: Any, req_id: str, cache: Any, src_ids: list[int], *, first_token: int,
             num_prompt_tokens: int, corrupt: bool = False) -> Any:
        """Send the request's KV (or a pointer to it) over ``link``; returns what P keeps alive
        until D's ack (a staging buffer ZMQ sends zero-copy), or None. With :attr:`verify` it
        carries the blocks' digests; ``corrupt`` (``KVFLOW_FAULT_KV_CORRUPT``) flips a byte of the
        last block after its digest. RuntimeError inside a dummy/profile run."""

    @abc.abstractmethod
    def send_part(self, link: Any, cache: Any, src_ids: list[int], layers: range,
                  **fields: Any) -> tuple[Any, float]:
        """Send layers ``layers`` of P's blocks ``src_ids`` as a ``KVLayer`` (``fields``: the
        header's); returns ``(keep, gather_ms)``. RuntimeError inside a dummy/profile run."""

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Create the layerwise sender (only when some prompt can go layerwise) and run a
        dummy prefill through it (:meth:`dummy_run`)."""
        if not self.layerwise_enabled:
            return
        from .layerwise import LayerwiseSender
        self.layerwise = LayerwiseSender(self, self.cache, self.instance_id,
                                         signal_timeout_s=self.signal_timeout_s)
        self.dummy_run(engine, chunk_size)

    @property
    def layerwise_ready(self) -> bool:
        """The layerwise sender exists (made at warm-up)."""
        return self.layerwise is not None

    def _attach(self, peer: Peer, ctx: Any) -> None:
        self.peer_specs[peer.id] = peer.spec
        if self.layerwise is not None:
            self.layerwise.open(ctx, peer.data_addr, peer.id)

    def detach(self, peer_id: str) -> None:
        super().detach(peer_id)
        self.peer_specs.pop(peer_id, None)
        if self.layerwise is not None:
            self.layerwise.close_peer(peer_id)

    def prepare(self, job: PrefillJob, layerwise: bool) -> None:
        """``job.decode_id`` is attached; a layerwise move is refused under :attr:`verify`.
        Not checked inside a dummy run."""
        super().prepare(job, layerwise)
        if layerwise and self.verify and sends_allowed():  # refused at start too
            raise TransferError(f"kv verify: {job.req_id} would move layer by layer, "
                                f"which --kv-verify does not check")

    def chunk_hook(self, job: PrefillJob, state: Any) -> Any:
        return self.layerwise.begin(job)

    def send_layerwise(self, job: PrefillJob, first_token: int, state: Any, *,
                       prefill_ms: float = 0.0) -> Kept:
        """The last part carries the first token; P's blocks are held until D's ack; a part
        that fails later comes out of :meth:`pop_errors`."""
        self.layerwise.finish(job.req_id, first_token)
        return Kept(list(job.blocks), peer=job.decode_id)

    def cancel(self, req_id: str, rec: Prefilling) -> None:
        if rec.layerwise and self.layerwise is not None:
            self.layerwise.abort(req_id)

    def reblocks(self, decode_id: str) -> bool:
        return self.peer_specs.get(decode_id, self.spec) != self.spec

    def send_prefilled(self, job: PrefillJob, first_token: int, *,
                       prefill_ms: float = 0.0) -> Kept:
        """One message (:meth:`send`) for the prompt's blocks past D's prefix hit (all of P's
        blocks when D's spec differs, :mod:`.reblocked`); ``prefill_ms`` is not sent."""
        skip = 0 if self.reblocks(job.decode_id) else min(job.num_cached_blocks, len(job.blocks))
        corrupt = False
        if self.verify:
            if self.reblocks(job.decode_id):
                raise TransferError(f"kv verify: D {job.decode_id}'s KV cache spec differs "
                                    f"from P's; --kv-verify does not check re-blocked moves")
            from kvflow.serve.instance import faults
            corrupt = faults.fails("corrupt", job.token_ids)
        keep = self.send(self.link_to(job.decode_id), job.req_id, self.cache, job.blocks[skip:],
                         first_token=first_token, num_prompt_tokens=len(job.token_ids),
                         corrupt=corrupt)
        self.messages_sent += 1
        return Kept(list(job.blocks) if self.holds_blocks else [], keep, job.decode_id)

    def release(self, req_id: str) -> None:
        if self.layerwise is not None:
            self.layerwise.abort(req_id)

    def pop_errors(self) -> list[tuple[str, BaseException]]:
        return self.layerwise.pop_errors() if self.layerwise is not None else []

    def close(self) -> None:
        if self.layerwise is not None:
            self.layerwise.close()  # before the ZMQ context ends: it owns sockets
        super().close()


class FramedReceiver(KVReceiver):
    """Base of D's halves (ipc-pull, tcp): ``peers`` (paired P -> what the kind keeps of it),
    ``peer_id`` (the last paired), ``parts``; ``head_start``: as :func:`~.make_receiver`'s."""

    verify = False  # --kv-verify: check P's digests after the copy (set by the instance)

    def __init__(self, spec=None, device: Any = "cpu", *, backend: str = "auto",
                 head_start: int | None = None, receive_max_ctas: int = RECEIVE_MAX_CTAS) -> None:
        super().__init__(spec, device, backend=backend)
        self.receive_max_ctas = receive_max_ctas
        self.head_start, self.parts, self.peers, self.peer_id = head_start, LayerParts(), {}, ""

    def detach(self, peer_id: str) -> None:
        self.peers.pop(peer_id, None)

    def forget(self, req_id: str) -> None:
        self.parts.forget(req_id)

    def close(self) -> None:
        self.peers.clear()
