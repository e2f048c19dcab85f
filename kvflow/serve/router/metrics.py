"""Prometheus metrics of the router (``GET /metrics``), on a registry of its own
(docs/tutorials/quickstart.md, "5. Metrics"); each metric's help text says what it measures."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_XFER = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """The router's metric objects; :meth:`render` gives the text exposition format."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("kvflow_ttft_seconds", "Time to first token (s)", buckets=_LAT, registry=r)
        self.tpot = Histogram("kvflow_tpot_seconds", "Time per output token after the first (s)",
                              buckets=_LAT, registry=r)
        self.transfer_bytes = Counter("kvflow_transfer_bytes", "KV payload bytes moved P->D",
                                      ["connector"], registry=r)
        self.transfer_blocks = Counter("kvflow_transfer_blocks", "KV blocks moved P->D",
                                       ["connector"], registry=r)
        self.transfer_seconds = Histogram("kvflow_transfer_seconds", "KV transfer time P->D (s)",
                                          ["connector"], buckets=_XFER, registry=r)
        self.free_blocks = Gauge("kvflow_free_blocks", "Free KV blocks", ["instance", "role"], registry=r)
        self.num_blocks = Gauge("kvflow_num_blocks", "KV blocks", ["instance", "role"], registry=r)
        self.requests = Counter("kvflow_requests", "Finished requests", ["outcome"], registry=r)
        for outcome in ("ok", "error", "aborted"):  # every series from the start, at 0
            self.requests.labels(outcome)

    def observe_transfer(self, kv: dict) -> None:
        if kv.get("kv_connector", "none") != "none":
            t = kv["kv_connector"]
            self.transfer_bytes.labels(t).inc(kv.get("payload_bytes", 0))
            self.transfer_blocks.labels(t).inc(kv.get("blocks", 0))
            self.transfer_seconds.labels(t).observe(kv.get("transfer_ms", 0.0) / 1e3)

    def set_blocks(self, instance: str, role: str, free: int, total: int) -> None:
        self.free_blocks.labels(instance, role).set(free)
        self.num_blocks.labels(instance, role).set(total)

    def forget(self, instance: str, role: str) -> None:
        for g in (self.free_blocks, self.num_blocks):
            with contextlib.suppress(KeyError):
                g.remove(instance, role)

    def render(self) -> bytes:
        return generate_latest(self.registry)
