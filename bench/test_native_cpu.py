"""CPU benchmarks of the native extension (``kvflow._native``), each beside its baseline in the
same run:

- gather / scatter, ``native`` (C++ thread pool of memcpy) vs ``numba`` (prange), at the
  geometry of bench/conftest.py (Llama-3-8B, 64 of 256 blocks, 512 MiB payload;
  ``KVFLOW_BENCH_QUICK=1``: 8 MiB);
- layer-signal round trip across two processes, p50 / p99: the parent signals layer 0 step k,
  a child process waits for it and answers on its own segment, the parent waits for the answer.
  ``native``: C++ store + C++ wait on both sides; ``native_sender``: the parent's store goes
  through the native kv signal sender thread; ``python``: kvflow.signal's SignalChannel and
  SignalReader on both sides. Each side waits with its implementation's default policy (native:
  spin 50 us yielding the core, then 20 us sleeps; Python: spin 50 us, then sleeps doubling
  from 10 us to 1 ms), which is what a deployment gets on a loaded host.

Run: ``python -m pytest bench/test_native_cpu.py --benchmark-only -q`` (bench/README.md).
``KVFLOW_BENCH_OUT=<dir>`` writes the rows to ``<dir>/native_cpu.json``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from kvflow.bench.schema import env_info, make_row
from kvflow.bench.timing import median, time_calls
from kvflow.kernels import available_backends, gather_blocks, scatter_blocks

from conftest import QUICK, ROUNDS, WARMUP, write_rows_if_asked

RTT_ROUNDS, RTT_WARMUP = (200, 20) if QUICK else (2000, 100)
_ROWS: list[dict] = []

pytestmark = pytest.mark.skipif(available_backends().get("native") != "available",
                                reason=f"native backend: {available_backends().get('native')}")


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if not _ROWS or tr is None or capman is None:
        return
    with capman.global_and_fixture_disabled():  # print past pytest's output capture
        _print_rows(tr)


def _print_rows(tr) -> None:
    tr.write_line("")
    tr.section("kvflow native vs baselines (same run)")
    for r in _ROWS:
        if r["op"] == "signal_rtt":
            tr.write_line(f"signal round trip  {r['backend']:<14} p50 {r['p50_us']:8.1f} us   "
                          f"p99 {r['p99_us']:8.1f} us   ({r['rounds']} rounds)")
        else:
            tr.write_line(f"{r['op']:<8} {r['backend']:<7} {r['payload_bytes'] / 2**20:6.0f} MiB "
                          f"{r['time_s'] * 1e3:8.2f} ms {r['gbps']:7.2f} GB/s  ratio {r['ratio']:.2f}"
                          f"  x numba {r['baseline_ratio'] or 0:.2f}")
    write_rows_if_asked(tr, "native_cpu.json", _ROWS)


def _measure(benchmark, fn, rounds: int, warmup: int) -> list[float]:
    """Seconds of each timed call: through pytest-benchmark, or (``--benchmark-disable``) timed
    here the same way, so the figures exist in both modes."""
    if not getattr(benchmark, "disabled", False):
        benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup)
        return list(benchmark.stats.stats.data)
    return time_calls([fn], warmup=warmup, reps=rounds)


@pytest.mark.parametrize("backend", ["numba", "native"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_gather_scatter(benchmark, ops_bench, op, backend):
    ob = ops_bench
    if op == "gather":
        fn = lambda: gather_blocks(ob.cache, ob.ids, ob.buf, backend=backend)  # noqa: E731
    else:  # writes back the blocks gathered from the same ids: the cache stays as it was
        gather_blocks(ob.cache, ob.ids, ob.buf, backend="torch")
        fn = lambda: scatter_blocks(ob.buf, ob.cache, ob.ids, backend=backend)  # noqa: E731
    benchmark.group = f"native-vs-numba {op}"
    times = _measure(benchmark, fn, ROUNDS, WARMUP)
    ceiling_s = median([ob.time_copy() for _ in range(ROUNDS)])  # same run, same payload
    key = f"native_cpu:{op}:numba"
    if backend == "numba":
        ob.baseline_s[key] = median(times)
    row = make_row(ob.env, op=op, backend=backend, spec=ob.spec, tokens=ob.ids.numel() * ob.spec.block_size,
                   blocks=ob.ids.numel(), payload_bytes=ob.payload, times_s=times, ceiling_s=ceiling_s,
                   baseline_s=ob.baseline_s.get(key),
                   config={"quick": QUICK, "cache_blocks": ob.cache.num_blocks, "baseline": "numba",
                           "native_threads": os.environ.get("KVFLOW_NATIVE_THREADS", "0")})
    benchmark.extra_info.update(row)
    _ROWS.append(row)


# ---- signal round trip -----------------------------------------------------------------------
_ECHO = r"""
import sys
kind, ping, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "python":
    from kvflow.signal import SignalChannel, SignalReader
    reader, pong = SignalReader(ping), SignalChannel.create("rtt_pong", 1)
    wait = lambda k: reader.wait(0, k, 30.0)
else:
    from kvflow.native_signal import NativeSignalChannel
    reader, pong = NativeSignalChannel.attach(ping), NativeSignalChannel.create("rtt_pong", 1)
    wait = lambda k: reader.wait(0, k, 30.0)
print(pong.name, flush=True)
for k in range(1, total + 1):
    wait(k)
    pong.signal(0, k)
sys.stdin.read()  # keep the segment until the parent has read the last answer
pong.close()
"""


@pytest.mark.parametrize("kind", ["native", "native_sender", "python"])
def test_signal_round_trip(benchmark, kind):
    from kvflow.native_signal import NativeLayerSignaller, NativeSignalChannel
    from kvflow.signal import SignalChannel, SignalReader

    total = RTT_ROUNDS + RTT_WARMUP
    iid = "rtt_" + secrets.token_hex(4)
    sender = None
    if kind == "python":
        ping = SignalChannel.create(iid, 1)
        signal = ping.signal
    elif kind == "native":
        ping = NativeSignalChannel.create(iid, 1)
        signal = ping.signal
    else:
        sender = NativeLayerSignaller(iid, 1)
        ping = sender.init()
        signal = sender.signal
    child = subprocess.Popen([sys.executable, "-c", _ECHO, "python" if kind == "python" else "native",
                              ping.name, str(total)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pong_name = child.stdout.readline().strip()
        if kind == "python":
            pong = SignalReader(pong_name)
        else:
            pong = NativeSignalChannel.attach(pong_name)
        wait = lambda k: pong.wait(0, k, 30.0)  # noqa: E731
        step = [0]

        def one_round():
            step[0] += 1
            signal(0, step[0])
            wait(step[0])

        benchmark.group = "signal round trip"
        ts = sorted(_measure(benchmark, one_round, RTT_ROUNDS, RTT_WARMUP))
        assert step[0] == total
        pong.close()
    finally:
        child.communicate(timeout=30)
        (sender or ping).close()
    p50, p99 = ts[len(ts) // 2], ts[min(len(ts) - 1, int(0.99 * len(ts)))]
    row = make_row(env_info("cpu"), op="signal_rtt", backend=kind, spec=None, tokens=0, blocks=0,
                   payload_bytes=0, times_s=ts, ceiling_s=None, p50_us=p50 * 1e6, p99_us=p99 * 1e6,
                   rounds=len(ts), config={"quick": QUICK, "wait": "default", "processes": 2})
    benchmark.extra_info.update(row)
    _ROWS.append(row)
