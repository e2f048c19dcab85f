"""``KvflowConnector``: kvflow as an out-of-tree vLLM (>= 0.32) KV connector; D pulls the
prompt's blocks after P's prefill over transport ``tcp``, ``nixl`` or ``ipc-push``. Settings,
one request's hooks, the failure rules: docs/tutorials/vllm.md."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)
from vllm.logger import init_logger

from kvflow.cache import PagedKVCache
from kvflow.vllm_layout import from_vllm

from .config import check_config
from .ipc_push import staging_blocks_for
from .link import PullError
from .params import check_params, prompt_hash
from .transfer import KVServer, open_puller

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = init_logger("vllm.kvflow")  # under "vllm", so vLLM's log handler prints it


@dataclasses.dataclass
class RecvJob:
    """D: pull P's ``remote_ids`` into D's ``local_ids`` (empty: only release P's blocks)."""
    req_id: str
    addr: str
    remote_req_id: str
    remote_ids: list[int] = dataclasses.field(default_factory=list)
    local_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvflowMeta(KVConnectorMetadata):
    """Scheduler -> worker, once per step: D's pulls, P's newly held requests."""
    recv: list[RecvJob] = dataclasses.field(default_factory=list)
    hold: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)  # (req, P's ids)


class KvflowConnector(KVConnectorBase_V1):
    """kvflow's vLLM KV connector (module docstring); ValueError for a bad
    ``kv_connector_extra_config`` (:func:`.config.check_config`)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.conf = check_config(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.addr = f"tcp://{self.conf['kvflow_host']}:{int(self.conf['kvflow_port'])}"
        self.block_size = vllm_config.cache_config.block_size
        self._recv: list[RecvJob] = []                     # scheduler side
        self._hold: list[tuple[str, list[int]]] = []
        self.cache: PagedKVCache | None = None             # worker side
        self.server: KVServer | None = None
        self.puller: Any = None
        self._jobs: queue.Queue = queue.Queue()
        self._done_recv, self._failed_blocks, self._lock = set(), set(), threading.Lock()

    def _release(self, request: "Request", params: dict[str, Any]) -> None:
        params["do_remote_prefill"] = False
        self._recv.append(RecvJob(request.request_id, params["remote_addr"],
                                  params["remote_request_id"]))

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """D: the prompt tokens P holds beyond D's prefix hit, loaded asynchronously; params
        of another prompt (:func:`.params.check_params`) load nothing."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        why = check_params(params, prompt, self.block_size)
        if why:
            log.error("kvflow: request %s: %s; D computes the prompt itself",
                      request.request_id, why)
            params["do_remote_prefill"] = False
            if not why.startswith(("remote_addr", "remote_request_id")):  # a P to release
                self._release(request, params)
            return 0, False
        count = len(prompt) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """D: pair P's logical blocks past D's prefix hit with the blocks D just allocated."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        remote = list(params["remote_block_ids"])
        job = RecvJob(request.request_id, params["remote_addr"], params["remote_request_id"])
        if num_external_tokens > 0:
            group = blocks.blocks[0]
            hit = 0
            while hit < len(group) and group[hit].block_hash is not None:
                hit += 1
            local = [b.block_id for b in group[hit:len(remote)]]
            job.remote_ids, job.local_ids = remote[hit:hit + len(local)], local
        params["kvflow_pulled_blocks"] = len(job.local_ids)
        self._recv.append(job)

    def build_connector_meta(self, scheduler_output: Any) -> KvflowMeta:
        meta = KvflowMeta(recv=self._recv, hold=self._hold)
        self._recv, self._hold = [], []
        return meta

    def request_finished(self, request: "Request",
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the prompt's blocks for D and return where they are."""
        from vllm.v1.request import RequestStatus
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):  # D, never allocated (aborted while waiting)
            self._release(request, params)
            return False, None
        if not params.get("do_remote_decode"):
            return False, {"kvflow_pulled_blocks": params["kvflow_pulled_blocks"]} \
                if "kvflow_pulled_blocks" in params else None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # P aborted: free now, nothing to send
        prompt = list(request.prompt_token_ids or [])
        if block_ids and isinstance(block_ids[0], (list, tuple)):  # one list per cache group
            block_ids = block_ids[0]
        ids = list(block_ids)[:-(-len(prompt) // self.block_size)]
        if not ids:
            return False, None
        self._hold.append((request.request_id, ids))
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_addr": self.addr, "remote_request_id": request.request_id,
                      "remote_block_ids": ids, "remote_num_tokens": len(prompt),
                      "remote_prompt_hash": prompt_hash(prompt)}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap vLLM's per-layer tensors (no copy); P starts serving pulls, D its loader."""
        self.cache = from_vllm(kv_caches)
        transport, backend = self.conf["transport"], self.conf["backend"]
        log.info("kvflow: %s over %d blocks (%s, transport %s)", self.cache.spec,
                 self.cache.num_blocks, self._kv_transfer_config.kv_role, transport)
        if self._kv_transfer_config.is_kv_producer:
            self.server = KVServer(self.cache, self.addr, transport=transport, backend=backend,
                                   delay_s=float(self.conf["test_serve_delay_s"]))
        if self._kv_transfer_config.is_kv_consumer:
            longest = -(-self._vllm_config.model_config.max_model_len // self.block_size)
            blocks = staging_blocks_for(self.cache.spec, longest,
                                        int(self.conf["staging_mb"] * (1 << 20)))
            self.puller = open_puller(transport, self.cache, timeout_s=self.conf["timeout_s"],
                                      backend=backend, corrupt=bool(self.conf["test_corrupt_kv"]),
                                      staging_blocks=blocks)
            if transport == "ipc-push":
                log.info("kvflow: ipc-push staging cache %s of %d blocks (%d bytes)",
                         self.puller.name, blocks, blocks * self.cache.spec.bytes_per_block)
            threading.Thread(target=self._load_loop, name="kvflow-kv-loader", daemon=True).start()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand this step's pulls to the loader thread; P holds finished requests."""
        meta = self._connector_metadata
        if not isinstance(meta, KvflowMeta):
            return
        for req_id, ids in meta.hold if self.server is not None else ():
            self.server.hold(req_id, self.conf["lease_s"], ids)
        for job in meta.recv:
            self._jobs.put(job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: D computes a pulled request once :meth:`get_finished` reported it."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing: D pulls after the prefill."""

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(P: requests whose blocks P may free, D: requests whose pull ended)``."""
        sent = self.server.take_done() if self.server is not None else set()
        with self._lock:
            recv, self._done_recv = self._done_recv, set()
        return (sent or None), (recv or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """D's blocks of pulls that failed."""
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        self._jobs.put(None)

    def _load_loop(self) -> None:
        puller = self.puller
        while (job := self._jobs.get()) is not None:
            if not job.local_ids:
                puller.release(job.addr, job.remote_req_id)
                continue
            t0, failed = time.perf_counter(), []
            try:
                nbytes = puller.pull(job.addr, job.remote_req_id, job.remote_ids, job.local_ids)
                log.info("kvflow: pulled %d blocks (%d bytes) of %s in %.2f ms over %s",
                         len(job.local_ids), nbytes, job.req_id,
                         (time.perf_counter() - t0) * 1e3, self.conf["transport"])
            except (PullError, ValueError, OSError) as exc:
                log.error("kvflow: %s", exc)
                failed = job.local_ids
            except Exception as exc:  # the loader must outlive any one request
                log.exception("kvflow: request %s: pull failed: %r", job.req_id, exc)
                failed = job.local_ids
            with self._lock:
                self._failed_blocks.update(failed)
                self._done_recv.add(job.req_id)
        puller.close()
