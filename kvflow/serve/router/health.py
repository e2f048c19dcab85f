"""The router's ``/health`` body: mode, readiness, each instance and its liveness, errors."""

from __future__ import annotations

import time
from typing import Any

from .placement import InstanceInfo


def _spec_differs(ctl: Any, info: InstanceInfo) -> dict:
    """``{peer id: {field: [ours, theirs]}}`` for each paired peer whose KV cache spec differs."""
    out = {}
    for peer_id in sorted(info.pair_ok):
        peer = ctl.instances.get(peer_id)
        if peer is None:
            continue
        diff = {k: [v, peer.reg.spec.get(k)] for k, v in info.reg.spec.items()
                if peer.reg.spec.get(k) != v}
        if diff:
            out[peer_id] = diff
    return out


def health_report(ctl: Any) -> dict:
    """The ``/health`` JSON of a :class:`~kvflow.serve.router.control.Controller` ``ctl``."""
    now = time.monotonic()
    return {"status": "ok" if ctl.ready() else "starting", "mode": ctl.mode,
            "control_addr": ctl.addr,
            "instances": [{"id": i.id, "role": i.role, "pid": i.reg.pid,
                           "kv_connector": i.reg.kv_connector, "num_blocks": i.reg.num_blocks,
                           "free_blocks": i.free_blocks, "num_running": i.num_running,
                           "heartbeat_age_s": now - i.heartbeat_at,
                           "liveness": i.liveness,
                           "max_model_len": i.reg.max_model_len, "spec": i.reg.spec,
                           "shm_name": i.reg.shm_name, "data_addr": i.reg.data_addr,
                           "lease_addr": i.reg.lease_addr,
                           "paired_with": sorted(i.pair_ok),
                           "spec_differs": _spec_differs(ctl, i)}
                          for i in ctl.instances.values()],
            "router_stalled_s": ctl.stalls.stalled_s,
            "errors": ctl.errors[-20:]}
