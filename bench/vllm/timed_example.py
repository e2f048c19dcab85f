"""vLLM's own ``ExampleConnector`` (P saves each layer's KV of a prompt to safetensors files in a
shared folder, D loads them), timed: the baseline of ``python -m bench.vllm.pd``. Logs the ms
P spends saving a step's layers and D spends loading a request's layers (``timed-example:``)."""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.logger import init_logger

log = init_logger("vllm.kvflow.bench")


class TimedExampleConnector(ExampleConnector):
    """ExampleConnector with its save and load timed (nothing else changed)."""

    _save_s = 0.0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        loads = [r for r in self._get_connector_metadata().requests if not r.is_store]
        if loads:
            log.info("timed-example: load %.3f ms", (time.perf_counter() - t0) * 1e3)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._save_s += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if self._save_s:
            log.info("timed-example: save %.3f ms", self._save_s * 1e3)
            self._save_s = 0.0
