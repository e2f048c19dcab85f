"""P's WRITEs of a request's KV into a paired D over NIXL, in the shape of
:class:`~kvflow.connector.layer_copy.LayerCopier` (``start``, ``pairs``, ``layer_hook``,
``finish``), so :class:`~kvflow.connector.ipc_push.PushSender`'s prefill drives it. The modes
(``direct``, ``staged``): docs/nixl.md, "How it works"; ``staged`` writes in the last chunk
only. Every WRITE is waited for in :meth:`NixlWriter.finish`, before ``KVPushed``.
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
from .transport.event_poster import EventPoster

#: Seconds P waits for a D's staging slot (its ``slot`` or ``free`` notification).
SLOT_TIMEOUT_S = 10.0
#: ``free`` notices a staged P keeps for requests it has not written (yet) into D's slot.
EARLY_FREES = 256


@dataclasses.dataclass
class NixlPeer:
    """A paired D as P's writer sees it (its instance id, agent name and cache blocks)."""
    id: str
    agent: str
    num_blocks: int
    remote: Any = None  # D's prepared descriptor list (direct: its cache; staged: its staging)
    plan: Any = None  # direct: the DescPlan of D's cache (``remote``'s rows)
    slot: int | None = None  # staged: D's slot for this P (None until D's ``slot`` notice)
    slot_descs: int = 0  # staged: descriptors per slot
    last_req: str = ""  # staged: the request last written into the slot ('' : none)
    spec: Any = None  # D's spec (equal to P's)
    #: staged: requests D freed before P wrote them (oldest first, at most EARLY_FREES)
    early: dict = dataclasses.field(default_factory=dict)


class NixlWriter:
    """Posts and waits for WRITEs from P's ``cache``, registered with ``agent`` (``local``: its
    prepared descriptor list, laid out by ``plan``, a :class:`~.transport.nixl_plan.DescPlan`),
    and, staged, from P's flat uint8 ``staging`` buffer
    (``local_staging``: its ``block_bytes`` descriptors). ``backend``: the gather's kernels;
    ``timeout_s``: seconds to wait for a request's WRITEs. On a GPU a direct layer group's
    WRITE is posted by an :class:`~.transport.event_poster.EventPoster` once a CUDA event
    recorded after the group is done: the compute thread never synchronizes its stream."""

    def __init__(self, agent: Any, cache: Any, local: Any, mode: str, layers_per_copy: int, *,
                 plan: Any = None, staging: Any = None, local_staging: Any = None,
                 backend: str = "auto", timeout_s: float = 30.0) -> None:
        self.agent, self.cache, self.local, self.mode = agent, cache, local, mode
        self.plan = plan
        self.layers_per_copy, self.backend, self.timeout_s = layers_per_copy, backend, timeout_s
        self.staging, self.local_staging = staging, local_staging
        self.handles: list[Any] = []
        self.job: Any = None  # the request being written (staged)
        self._ids: tuple[Any, Any] | None = None  # (job, its ids) of the staged gathers
        self.fault_delay_s, self.fault_fail, self.dropped = 0.0, False, ""  # test faults
        self.posted = 0  # WRITEs posted for the request
        on_gpu = cache is not None and cache.buffer.is_cuda and mode == "direct"
        self.poster = EventPoster("kvflow-nixl-poster") if on_gpu else None

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
        self.posted = 0
        if self.mode != "staged":
            return
        spec = self.cache.spec
        nb = spec.num_blocks_for(len(job.token_ids))
        n = nb - min(job.num_cached_blocks, nb)
        fits = peer.slot_descs // spec.num_tensors
        if n > fits:
            raise TransferError(f"request {job.req_id} moves {n} blocks ({len(job.token_ids)} "
                                f"tokens, {job.num_cached_blocks} cached on D); a staging slot "
                                f"of decode instance {peer.id} holds {fits}")

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
        try:
            if self.poster is not None:  # the layer groups' WRITEs, posted in its thread
                posted, error = self.poster.drain()
                self.handles += posted
                if error is not None:
                    raise error
            if stats is not None and stats.pending is not None:
                pending, stats.pending = stats.pending, None
                L = self.cache.spec.num_layers
                on_host = not self.cache.buffer.is_cuda
                step = self.layers_per_copy if self.mode == "staged" and on_host else L
                for lo in range(0, L, step):
                    self._write(pending, range(lo, min(lo + step, L)), stats, now=True)
            handles, self.handles = self.handles, []
            if handles:  # wait releases them, done or not
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
        """Release the handles of WRITEs never waited for."""
        self.agent.drop(self.handles)
        self.handles = []

    def stop(self) -> None:
        """Stop the poster's thread (the sender closes)."""
        if self.poster is not None:
            self.poster.drain()
            self.poster.close()

    def _write(self, pairs, layers: range, stats: Any, now: bool = False) -> None:
        """Post the WRITE of ``layers`` of ``pairs`` (direct on a GPU and not ``now``: through
        the poster, after the GPU computed them; else here, after a stream sync)."""
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
        handle = None
        if self.mode == "direct":
            src, dst = pairs
            local, remote = self.plan.indices(src, layers), peer.plan.indices(dst, layers)

            def post():
                return self.agent.write(self.local, local, peer.remote, remote, what)
            if self.poster is not None and not now:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.cache.buffer.device))
                self.poster.submit(event, post)
                self.posted += 1
            else:
                self._settle()
                handle = post()
        else:  # None: no block to move (D's prefix cache holds them all)
            handle = self._write_staged(peer, layers, tensors, what)
            peer.last_req = self.job.req_id
        if handle is not None:
            self.handles.append(handle)
            self.posted += 1
        stats.copy_ms += (time.perf_counter() - t0) * 1e3
        if self.fault_delay_s:  # KVFLOW_FAULT_WRITE_DELAY_S: kill or abort D meanwhile
            time.sleep(self.fault_delay_s)

    def _ids_of(self, job: Any) -> Any:
        """P's ids of the blocks ``job`` moves, once per request (on a GPU a device tensor)."""
        if self._ids is not None and self._ids[0] is job:
            return self._ids[1]
        nb = self.cache.spec.num_blocks_for(len(job.token_ids))
        ids: Any = list(job.blocks[min(job.num_cached_blocks, nb):nb])
        if self.cache.buffer.is_cuda and ids:
            ids = torch.tensor(ids, dtype=torch.int32).to(self.cache.buffer.device)
        self._ids = (job, ids)
        return ids

    def _settle(self) -> None:
        """On a GPU, wait for P's stream (NIXL reads memory outside it)."""
        if self.cache.buffer.is_cuda:
            torch.cuda.current_stream(self.cache.buffer.device).synchronize()

    def _write_staged(self, peer: NixlPeer, layers: range, tensors: range, what: str):
        """Gather ``layers`` of the request's blocks into staging and WRITE them into D's slot;
        None when the request moves no block."""
        spec, job = self.cache.spec, self.job
        ids = self._ids_of(job)
        n = len(ids)
        if n == 0:
            return None
        lo, hi = tensors.start * n, tensors.stop * n  # in block_bytes units
        out = self.staging[lo * spec.block_bytes:hi * spec.block_bytes]
        out = out.view(spec.dtype).view(staging_shape(spec, n, layers))
        gather_blocks(self.cache, ids, out, layers, backend=self.backend)
        self._settle()
        base = peer.slot * peer.slot_descs
        idx = np.arange(lo, hi, dtype=np.int32)
        return self.agent.write(self.local_staging, idx, peer.remote, base + idx, what)

