"""The one launcher of tests and studies (kvflow/bench/ports.py): ports outside the ephemeral
range, handed out once; a server whose port was taken before it bound it is started again on
another port (bounded); a server of another process answering on the port is never taken for
ours; two kvflow.serve routers started at once on the same first port both come up."""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvflow.bench.ports import (Launch, free_port, http_ok, listening, port_free, serve_cmd,
                                wait_healthy)

#: a /health server on the port in argv[1]; argv[2]: seconds to wait before binding
_FAKE = ("import http.server, sys, time\n"
         "time.sleep(float(sys.argv[2]))\n"
         "class H(http.server.BaseHTTPRequestHandler):\n"
         "    def do_GET(self):\n"
         "        self.send_response(200 if self.path == '/health' else 404)\n"
         "        self.end_headers()\n"
         "    def log_message(self, *a):\n"
         "        pass\n"
         "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def _fake(delay_s: float = 0.0):
    return lambda port: [sys.executable, "-c", _FAKE, str(port), str(delay_s)]


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.kill()
        p.wait()


def _ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = f.read().split()
    return int(lo), int(hi)


def test_free_port_is_outside_the_ephemeral_range_and_handed_out_once():
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == 100
    assert [p for p in ports if lo <= p <= hi or p < 1024] == [], (lo, hi)
    assert all(port_free(p) for p in ports)


def test_free_port_when_the_ephemeral_range_covers_every_port(monkeypatch):
    """No room outside (``ip_local_port_range`` 1024-65535): the kernel's pick, still free and
    still handed out once."""
    import kvflow.bench.ports as ports
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    got = [free_port() for _ in range(20)]
    assert len(set(got)) == 20 and all(port_free(p) for p in got)


def test_port_taken_by_another_server_is_retried_on_a_new_port():
    """The first port is held by another process's /health server (answering 200 before ours
    binds): that answer is not taken for ours; ours exits with the port in use and is started
    on the next port."""
    taken = free_port()
    other = subprocess.Popen(_fake()(taken))
    try:
        deadline = time.monotonic() + 30
        while not http_ok(f"http://127.0.0.1:{taken}") and time.monotonic() < deadline:
            time.sleep(0.05)
        picks = itertools.chain([taken], iter(free_port, None))
        launch = Launch(_fake(0.5), pick=lambda: next(picks), stderr=subprocess.DEVNULL)
        assert launch.poll(lambda: http_ok(launch.url)) is False  # 200, but from `other`
        wait_healthy(launch, timeout=30)
        try:
            assert launch.taken == [taken] and launch.port != taken
            assert (("127.0.0.1", launch.port) in listening(launch.proc.pid))
            assert ("127.0.0.1", taken) in listening(other.pid)
        finally:
            _stop(launch.proc)
    finally:
        _stop(other)


def test_retries_are_bounded():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        launch = Launch(_fake(), attempts=3, pick=lambda: port, stderr=subprocess.DEVNULL)
        with pytest.raises(RuntimeError) as err:
            wait_healthy(launch, timeout=30)
    assert str(err.value) == (f"ports [{port}, {port}, {port}] were each taken by another "
                              f"process before the server bound them (3 attempts)")


def test_other_exit_is_not_retried(tmp_path):
    launch = Launch(lambda port: [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
                    log_path=str(tmp_path / "log"))
    with pytest.raises(RuntimeError) as err:
        wait_healthy(launch, timeout=30)
    assert str(err.value) == (f"the server exited with code 3 before {launch.url} was ready:\n"
                              f"bad flag\n")
    assert launch.taken == []


def test_bad_attempts_refused():
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        Launch(_fake(), attempts=0)


def _answers(url: str) -> bool:
    """Any HTTP answer at ``url``/health (a router without instances says 503 "starting")."""
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def test_two_routers_started_at_once_on_the_same_port_both_serve(tmp_path):
    """What free_port's race did at load, made certain: two `python -m kvflow.serve --role
    router` get the same first port at once. One binds it, the other is started again on
    another port; each answers from its own router (its own control socket)."""
    first = free_port()
    launches = []

    def start(i: int) -> None:
        picks = itertools.chain([first], iter(free_port, None))
        launches.append(Launch(serve_cmd("--role", "router"), pick=lambda: next(picks),
                               log_path=str(tmp_path / f"router{i}.log")))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        deadline = time.monotonic() + 120
        for la in launches:
            while not la.poll(lambda: _answers(la.url)):
                assert time.monotonic() < deadline, la.output()
                time.sleep(0.1)
        assert sorted(len(la.taken) for la in launches) == [0, 1]
        assert sorted(la.port == first for la in launches) == [False, True]
        controls = []
        for la in launches:
            assert ("127.0.0.1", la.port) in listening(la.proc.pid)
            health = httpx.get(la.url + "/health", timeout=10).json()
            assert health["status"] == "starting" and health["instances"] == [], health
            controls.append(health["control_addr"])
            assert f"router listening on {la.url} " in la.output(), la.output()
        assert controls[0] != controls[1], controls
    finally:
        for la in launches:
            la.proc.send_signal(signal.SIGINT)
        for la in launches:
            assert la.proc.wait(60) == 0, la.output()
