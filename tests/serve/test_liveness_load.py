"""Liveness under load (issue 26): a router, a P and a D started separately (as
docs/tutorials/multihost.md's three commands) with the router's default --dead-after-s and
--hung-after-s, beside ten CPU hogs on the 2-core CI machine (load 10+). Idle, and then
prefilling back to back, neither P nor D is ever declared dead or asked to register again,
every request is answered 200 with the tokens it had before the load, and the largest
heartbeat age the router showed is printed (docs/reliability.md, "Liveness", cites it)."""

from __future__ import annotations

import os
import threading
import time

from kvflow.serve.launch.config import ServeConfig

from tests.load import cpu_hogs, load_average, runnable
from tests.serve.test_reliability_peers import Cluster

IDLE_S, BUSY_S = 12.0, 18.0
#: CPU hogs beside the deployment (KVFLOW_LOAD_HOGS=20 measures the figure at load 20)
HOGS = int(os.environ.get("KVFLOW_LOAD_HOGS", "10"))


def _watch(cl, stop: threading.Event, seen: dict) -> None:
    while not stop.is_set():
        h = cl.health()
        for i in h["instances"]:
            seen["age"][i["role"]] = max(seen["age"].get(i["role"], 0.0), i["heartbeat_age_s"])
            seen["ids"].add(i["id"])
        seen["errors"].update(h["errors"])
        seen["load"] = max(seen["load"], load_average())
        seen["runnable"] = max(seen["runnable"], runnable())
        stop.wait(0.2)


def test_split_deployment_stays_alive_idle_and_prefilling_at_load():
    cl = Cluster(dead_after_s=ServeConfig.dead_after_s, hung_after_s=ServeConfig.hung_after_s)
    try:
        cl.spawn("prefill", "--max-num-batched-tokens", "256")  # a 240-token prompt: one chunk
        cl.spawn("decode")
        cl.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 2, 150, "P and D paired")
        prompts = [[(s * 7 + 13 * i) % 240 + 10 for i in range(240)] for s in range(3)]
        want = []
        for p in prompts:
            r = cl.complete(prompt=p, max_tokens=4, ignore_eos=True, temperature=0)
            assert r.status_code == 200, r.text
            want.append(r.json()["choices"][0]["token_ids"])
        ids = {i["id"] for i in cl.health()["instances"]}
        seen = {"age": {}, "ids": set(), "errors": set(), "load": 0.0, "runnable": 0}
        prefill_ms = 0.0
        stop = threading.Event()
        with cpu_hogs(HOGS, max_s=IDLE_S + BUSY_S + 120):
            watcher = threading.Thread(target=_watch, args=(cl, stop, seen), daemon=True)
            watcher.start()
            try:
                time.sleep(IDLE_S)
                end, n = time.monotonic() + BUSY_S, 0
                while time.monotonic() < end:
                    k = n % len(prompts)
                    r = cl.complete(prompt=prompts[k], max_tokens=4, ignore_eos=True,
                                    temperature=0)
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["token_ids"] == want[k]
                    prefill_ms = max(prefill_ms, r.json()["kvflow"]["hops_ms"]["p_prefill"])
                    n += 1
            finally:
                stop.set()
                watcher.join(5)
        print(f"\nliveness at load ({HOGS} hogs): up to {seen['runnable']} runnable, 1-min load "
              f"up to {seen['load']:.1f}; {n} requests, longest prefill (one chunk) "
              f"{prefill_ms / 1e3:.2f} s; largest heartbeat age P "
              f"{seen['age'].get('prefill', 0):.2f} s, D {seen['age'].get('decode', 0):.2f} s")
        assert n >= 1
        assert seen["errors"] == set() and seen["ids"] == ids  # nobody died or came back
        assert seen["age"]["prefill"] < ServeConfig.dead_after_s
        assert seen["age"]["decode"] < ServeConfig.dead_after_s
    finally:
        cl.close()
