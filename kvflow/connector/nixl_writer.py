"""P's WRITEs of a request's KV into a paired D over NIXL, in the shape of
:class:`~kvflow.connector.layer_copy.LayerCopier` (``start``, ``pairs``, ``layer_hook``,
``finish``), so :class:`~kvflow.connector.ipc_push.PushSender`'s prefill drives it. The modes
(``direct``, ``staged``): docs/nixl.md, "How it works"; ``staged`` writes in the last chunk
only, one layer group at a time through :data:`PIPELINE_SLOTS` slots of P's staging buffer
(group g's WRITE in flight while group g + 1 is gathered). Every WRITE is waited for in
:meth:`NixlWriter.finish`, before ``KVPushed``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from kvflow.cache import staging_shape
from kvflow.kernels import gather_blocks

from .base import TransferError
from .layer_copy import block_pairs
from .transport.nixl_plan import desc_indices

#: Seconds P waits for a D's staging slot (its ``slot`` or ``free`` notification).
SLOT_TIMEOUT_S = 10.0
#: ``free`` notices a staged P keeps for requests it has not written (yet) into D's slot.
EARLY_FREES = 256
#: Slots of a staged P's staging buffer, each one layer group of the longest request.
PIPELINE_SLOTS = 2


@dataclasses.dataclass
class NixlPeer:
    """A paired D as P's writer sees it (its instance id, agent name and cache blocks)."""
    id: str
    agent: str
    num_blocks: int
    remote: Any = None  # D's prepared descriptor list (direct: its cache; staged: its staging)
    slot: int | None = None  # staged: D's slot for this P (None until D's ``slot`` notice)
    slot_descs: int = 0  # staged: descriptors per slot
    last_req: str = ""  # staged: the request last written into the slot ('' : none)
    spec: Any = None  # D's spec (equal to P's)
    #: staged: requests D freed before P wrote them (oldest first, at most EARLY_FREES)
    early: dict = dataclasses.field(default_factory=dict)


class NixlWriter:
    """Posts and waits for WRITEs from P's ``cache``, registered with ``agent`` (``local``: its
    prepared descriptor list), and, staged, from P's flat uint8 ``staging`` buffer
    (``local_staging``: its ``block_bytes`` descriptors). ``backend``: the gather's kernels;
    ``timeout_s``: seconds to wait for a request's WRITEs. Staged, ``staging`` holds
    :data:`PIPELINE_SLOTS` slots of ``slot_descs`` descriptors each."""

    def __init__(self, agent: Any, cache: Any, local: Any, mode: str, layers_per_copy: int, *,
                 staging: Any = None, local_staging: Any = None, slot_descs: int = 0,
                 backend: str = "auto", timeout_s: float = 30.0) -> None:
        self.agent, self.cache, self.local, self.mode = agent, cache, local, mode
        self.layers_per_copy, self.backend, self.timeout_s = layers_per_copy, backend, timeout_s
        self.staging, self.local_staging, self.slot_descs = staging, local_staging, slot_descs
        self.handles: list[Any] = []
        self.job: Any = None  # the request being written (staged)
        self._ids: tuple[Any, Any, bytes] | None = None  # (job, P's ids, D's ids) of its gathers
        self.group = 0  # staged: layer groups of the request gathered so far
        self.slot_h: list[Any] = [None] * PIPELINE_SLOTS  # staged: each slot's last WRITE
        self.ready: tuple | None = None  # staged, CUDA: (event, slot, WRITE) gathered, not posted
        self.fault_delay_s, self.fault_fail, self.dropped = 0.0, False, ""  # test faults
        self.posted = 0  # WRITEs posted for the request

    def start(self) -> None:
        """Nothing to order (LayerCopier interface)."""

    def begin(self, job: Any, peer: NixlPeer | None) -> None:
        """A new request ``job`` to ``peer``: staged, wait until its slot is free
        (TransferError when D sent no slot, or did not free it, within :data:`SLOT_TIMEOUT_S`)."""
        self.job = job
        if self.mode != "staged" or peer is None:
            return
        deadline = time.monotonic() + SLOT_TIMEOUT_S

        def wait(what: str, pause: float) -> None:
            if time.monotonic() > deadline:
                raise TransferError(f"decode instance {peer.id} {what} within "
                                    f"{SLOT_TIMEOUT_S:g} s")
            time.sleep(pause)
        while True:  # the newest notice is D's current slot (D sends it again after a failure)
            while (got := self.agent.take(peer.id, b"slot ")) is not None:
                peer.slot = int(got.split()[1])
            if peer.slot is not None:
                break
            wait("assigned this prefill instance no staging slot", 1e-3)
        while self._drain_free(peer):
            wait(f"did not free its staging slot of request {peer.last_req}", 1e-4)

    def check(self, job: Any, peer: NixlPeer) -> None:
        """Before :meth:`begin`: arm the test faults of ``job`` (:mod:`kvflow.serve.faults`);
        staged, TransferError when it moves more blocks than a slot of D's staging holds."""
        from kvflow.serve.instance import faults
        self.fault_delay_s = faults.delay_s("write", job.token_ids)
        self.fault_fail, self.dropped = faults.fails("write", job.token_ids), ""
        self.posted = self.group = 0
        if self.mode != "staged":
            return
        spec = self.cache.spec
        nb = spec.num_blocks_for(len(job.token_ids))
        n = nb - min(job.num_cached_blocks, nb)
        mine = self.slot_descs // spec.tensors_per_layer // min(self.layers_per_copy,
                                                                spec.num_layers)
        for fits, whose in ((peer.slot_descs // spec.num_tensors, f"decode instance {peer.id}"),
                            (mine, "this prefill instance")):
            if n > fits:
                raise TransferError(f"request {job.req_id} moves {n} blocks "
                                    f"({len(job.token_ids)} tokens, {job.num_cached_blocks} "
                                    f"cached on D); a staging slot of {whose} holds {fits}")

    def _drain_free(self, peer: NixlPeer) -> bool:
        """Take D's ``free`` notices (others' are kept in ``peer.early``); True while the slot
        is still taken."""
        while (got := self.agent.take(peer.id, b"free ")) is not None:
            req = got[len(b"free "):].decode()
            if req == peer.last_req:
                peer.last_req = ""
            else:  # maybe P writes it later: D ended it first and will never read its slot
                peer.early[req] = None
                while len(peer.early) > EARLY_FREES:
                    del peer.early[next(iter(peer.early))]
        if peer.last_req in peer.early:
            del peer.early[peer.last_req]
            peer.last_req = ""
        return bool(peer.last_req)

    def pairs(self, blocks, dst_ids, first: int, stop: int, skip: int, peer: NixlPeer | None):
        """:func:`~kvflow.connector.layer_copy.block_pairs` (``peer`` None: P's own cache)."""
        n = self.cache.num_blocks
        return block_pairs(blocks, dst_ids, first, stop, skip, n,
                           peer.num_blocks if peer is not None else n)

    def layer_hook(self, pairs, stats: Any, last_chunk: bool):
        """The engine's per-layer hook of one chunk: after each group of layers, post that
        group's WRITE (staged: in the ``last_chunk`` only, of every prompt block)."""
        L, G = self.cache.spec.num_layers, self.layers_per_copy
        if self.mode == "staged" and not last_chunk:
            return None

        def hook(layer: int) -> None:
            if (layer + 1) % G and layer != L - 1:
                return
            self._write(pairs, range(layer - layer % G, layer + 1), stats)
        return hook

    def finish(self, stats: Any = None) -> None:
        """Post the WRITE after the prefill (``stats.pending``, all layers), then wait for every
        WRITE posted (``stats.exposed_ms``: the time spent here). TransferError when a WRITE
        failed or did not finish within ``timeout_s``."""
        t0 = time.perf_counter()
        handles, self.handles = self.handles, []
        try:
            if stats is not None and stats.pending is not None:
                pending, stats.pending = stats.pending, None
                L = self.cache.spec.num_layers
                step = self.layers_per_copy if self.mode == "staged" else L
                for lo in range(0, L, step):
                    self._write(pending, range(lo, min(lo + step, L)), stats)
            if stats is not None:
                self._post_ready()
            handles, self.handles = handles + self.handles, []
            if handles:
                self.agent.wait(handles, self.timeout_s, f"{len(handles)} layer groups")
            if self.dropped:  # KVFLOW_FAULT_WRITE_FAIL: the later groups were never posted
                raise TransferError(f"NIXL WRITE of {self.dropped} failed: injected by "
                                    f"KVFLOW_FAULT_WRITE_FAIL")
        finally:
            self.close()
            self.dropped = ""
        if stats is not None:
            stats.exposed_ms = (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        """Release the handles of WRITEs never waited for (and forget one never posted)."""
        self.agent.drop(self.handles)
        self.handles, self.ready, self.slot_h = [], None, [None] * PIPELINE_SLOTS

    def _write(self, pairs, layers: range, stats: Any) -> None:
        t0 = time.perf_counter()
        if not stats.t_start:
            stats.t_start = time.time()
        peer: NixlPeer = stats.dst
        tpl = self.cache.spec.tensors_per_layer
        tensors = range(layers.start * tpl, layers.stop * tpl)
        what = f"layers [{layers.start}, {layers.stop}) to {peer.id}"
        if self.fault_fail and self.posted:  # KVFLOW_FAULT_WRITE_FAIL: only the first goes
            self.dropped = self.dropped or what
            return
        if self.mode == "direct":
            src, dst = pairs
            if self.cache.buffer.is_cuda:  # NIXL reads memory outside P's stream
                torch.cuda.current_stream(self.cache.buffer.device).synchronize()
            self.handles.append(self.agent.write(
                self.local, desc_indices(src, tensors, self.cache.num_blocks), peer.remote,
                desc_indices(dst, tensors, peer.num_blocks), what))
            self.posted += 1
        else:  # False: no block to move (D's prefix cache holds them all)
            self.posted += self._write_staged(peer, layers, tensors, what)
            peer.last_req = self.job.req_id
        stats.copy_ms += (time.perf_counter() - t0) * 1e3
        if self.fault_delay_s:  # KVFLOW_FAULT_WRITE_DELAY_S: kill or abort D meanwhile
            time.sleep(self.fault_delay_s)

    def _ids_of(self, job: Any) -> tuple[Any, bytes]:
        """P's ids of the blocks ``job`` moves (on a GPU a device tensor) and D's (the text of
        the notifications), once per request."""
        if self._ids is not None and self._ids[0] is job:
            return self._ids[1:]
        nb = self.cache.spec.num_blocks_for(len(job.token_ids))
        lo = min(job.num_cached_blocks, nb)
        ids: Any = list(job.blocks[lo:nb])
        if self.cache.buffer.is_cuda and ids:
            ids = torch.tensor(ids, dtype=torch.int32).to(self.cache.buffer.device)
        self._ids = (job, ids, ",".join(map(str, job.decode_block_ids[lo:nb])).encode())
        return self._ids[1:]

    def _write_staged(self, peer: NixlPeer, layers: range, tensors: range, what: str) -> bool:
        """Gather ``layers`` of the request's blocks into the next slot of P's staging (once
        that slot's last WRITE is done) and WRITE them to their place in D's slot, notifying
        ``kv LO HI D-IDS REQ``. On a GPU the WRITE is posted after the next group's gather is
        queued (or in :meth:`finish`). False when the request moves no block."""
        spec, job = self.cache.spec, self.job
        ids, dst = self._ids_of(job)
        n = len(ids)
        if n == 0:
            return False
        s, self.group = self.group % PIPELINE_SLOTS, self.group + 1
        if self.slot_h[s] is not None:  # the slot's WRITE, two groups ago, must be done
            h, self.slot_h[s] = self.slot_h[s], None
            self.handles = [x for x in self.handles if x is not h]
            self.agent.wait([h], self.timeout_s, f"a staging slot's WRITE to {peer.id}")
        k, lo = len(tensors) * n, s * self.slot_descs  # descriptors of block_bytes
        out = self.staging[lo * spec.block_bytes:(lo + k) * spec.block_bytes]
        out = out.view(spec.dtype).view(staging_shape(spec, n, layers))
        gather_blocks(self.cache, ids, out, layers, backend=self.backend)
        idx = np.arange(k, dtype=np.int32)
        base = peer.slot * peer.slot_descs + tensors.start * n  # the group's place in D's slot
        notif = b"kv %d %d %s %s" % (layers.start, layers.stop, dst, job.req_id.encode())
        ev = torch.cuda.Event() if out.is_cuda else None
        if ev is not None:
            ev.record(torch.cuda.current_stream(out.device))
        self._post_ready()
        self.ready = (ev, s, (self.local_staging, lo + idx, peer.remote, base + idx, what, notif))
        if ev is None:
            self._post_ready()
        return True

    def _post_ready(self) -> None:
        """Post the gathered group's WRITE, once its gather ran."""
        if self.ready is None:
            return
        (ev, s, args), self.ready = self.ready, None
        if ev is not None:
            ev.synchronize()
        self.handles.append(self.agent.write(*args))
        self.slot_h[s] = self.handles[-1]
