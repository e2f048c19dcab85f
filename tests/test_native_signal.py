"""The native signal path (``kvflow._native`` via :mod:`kvflow.native_signal`): segment bytes
identical to kvflow/signal/segment.py's, stores seen across processes, the kv signal sender's
drain on destroy and bounded completion waits, no-op sends before init, profile-run gating, and
the layerwise transfer driven by the native sender."""

from __future__ import annotations

import os
import secrets
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvflow import _native
from kvflow import native_signal as ns
from kvflow.context import forward_context
from kvflow.signal import Segment, SignalChannel, SignalReader, segment_bytes
from kvflow.signal.segment import SHM_DIR, process_start_time


def _iid() -> str:
    return "n_" + secrets.token_hex(4)


def _files(iid: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"kvflow-sig-{iid}-")]


@pytest.fixture(autouse=True)
def _clean_native_state():
    _native.set_profile_run(False)
    _native.reset_signal_layerwise()
    _native.reset_signal_stats()
    yield
    _native.set_profile_run(False)
    _native.reset_signal_layerwise()


def test_segment_bytes_are_the_python_layout():
    iid = _iid()
    ch = ns.NativeSignalChannel.create(iid, 3)
    path = os.path.join(SHM_DIR, ch.name)
    assert ch.name.startswith(f"kvflow-sig-{iid}-") and len(ch.name.rsplit("-", 1)[1]) == 16
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    raw = open(path, "rb").read()
    assert len(raw) == segment_bytes(3) == 4096 == _native.segment_bytes(3)
    magic, version, n, pid, start, created = struct.unpack_from("<8sIIQQQ", raw, 0)
    assert (magic, version, n, pid, start) == (b"KVFSIG01", 1, 3, os.getpid(), process_start_time(os.getpid()))
    assert abs(created - time.time_ns()) < 60e9 and raw[40:64] == b"\0" * 24
    assert np.frombuffer(raw[64:256], "<i8").reshape(3, 8).tolist() == [[-1] + [0] * 7] * 3
    assert ch.signal(1, 9) and ch.signal(1, 10)
    raw = open(path, "rb").read()
    assert struct.unpack_from("<qq", raw, 128) == (10, 2) and struct.unpack_from("<qq", raw, 64) == (-1, 0)
    assert raw[256:] == b"\0" * (4096 - 256)
    seg = Segment.attach(ch.name, num_layers=3)  # the Python side reads the native header
    assert (seg.owner_pid, seg.owner_start_time, seg.created_ns) == (pid, start, created)
    seg.close()
    ch.close()
    ch.close()  # idempotent
    assert not os.path.exists(path)


def test_python_writer_native_reader_and_back():
    py = SignalChannel.create(_iid(), 2)
    nat = ns.NativeSignalChannel.attach(py.name, num_layers=2)
    py.signal(1, 4)
    assert (nat.step(1), nat.count(1), nat.wait(1, 4, 1.0)) == (4, 1, 4)
    nat.close()
    py.close()
    nat = ns.NativeSignalChannel.create(_iid(), 2)
    reader = SignalReader(nat.name, num_layers=2)
    nat.signal(0, 6)
    assert (reader.step(0), reader.count(0)) == (6, 1)
    reader.close()
    nat.close()


def test_attach_errors_name_the_segment():
    with pytest.raises(RuntimeError, match=r"^cannot attach signal segment kvflow-sig-x-0000000000000000: "
                                           r"No such file or directory$"):
        ns.NativeSignalChannel.attach("kvflow-sig-x-0000000000000000")
    ch = ns.NativeSignalChannel.create(_iid(), 2)
    with pytest.raises(RuntimeError, match=f"^signal segment {ch.name} holds 2 layers; num_layers=3 was expected$"):
        ns.NativeSignalChannel.attach(ch.name, num_layers=3)
    with pytest.raises(ValueError, match=r"^step=3 for layer 0 is older than the layer's last signalled step 5; "
                                         r"steps must not decrease$"):
        ch.signal(0, 5), ch.signal(0, 3)
    with pytest.raises(IndexError, match=r"^layer=2 is outside the segment's 2 layers$"):
        ch.signal(2, 1)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=rf"^no signal for layer 1 step 1 in segment {ch.name} within 0.05 s "
                                           r"\(last step seen: -1\)$"):
        ch.wait(1, 1, 0.05)
    assert time.perf_counter() - t0 < 2.0
    ch.close()


_ECHO = """
import sys
from kvflow import _native
seg = _native.open_shm_and_get_meta_signal(sys.argv[1], 2, False)
for k in range(1, int(sys.argv[2]) + 1):
    seg.wait(0, k, 10.0)
    seg.write(1, k)
"""


def test_two_processes_round_trip():
    """Parent writes layer 0 step k; a child process waits for it and answers on layer 1."""
    rounds = 200
    ch = ns.NativeSignalChannel.create(_iid(), 2)
    child = subprocess.Popen([sys.executable, "-c", _ECHO, ch.name, str(rounds)])
    try:
        for k in range(1, rounds + 1):
            ch.signal(0, k)
            assert ch.wait(1, k, 10.0) == k
        assert child.wait(10) == 0
    finally:
        child.kill()
        ch.close()
    assert (ch.segment.closed, rounds) == (True, 200)


_PY_READER = """
import sys
from kvflow.signal import SignalReader
r = SignalReader(sys.argv[1], num_layers=4)
print([r.wait(l, 3, 10.0) for l in range(4)], [r.count(l) for l in range(4)])
"""


def test_native_sender_seen_by_python_reader_in_another_process():
    sig = ns.NativeLayerSignaller(_iid(), 4)
    sig.init()
    child = subprocess.Popen([sys.executable, "-c", _PY_READER, sig.name], stdout=subprocess.PIPE, text=True)
    flags = []
    for step in (1, 2, 3):
        for layer in range(4):
            flags.append(ns.CompletionFlag())
            assert sig.signal(layer, step, flags[-1])
    for f in flags:  # the "device" finishes the layers
        f.set()
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out.strip() == "[3, 3, 3, 3] [3, 3, 3, 3]"
    assert sig.close() == 12


def test_sender_drains_every_pending_item_on_destroy():
    seg = _native.open_shm_and_get_meta_signal(ns.new_segment_name(_iid()), 4, True)
    sender = _native.create_kv_signal_sender(seg, 10.0)
    flags = [_native.CompletionFlag() for _ in range(200)]
    for i, f in enumerate(flags):
        sender.enqueue(i % 4, i // 4, f)
    threading.Timer(0.05, lambda: [f.set() for f in flags]).start()
    assert sender.pending > 0
    assert _native.destroy_kv_signal_sender(sender) == 200  # waits for the flags, writes, joins
    assert [seg.step(layer) for layer in range(4)] == [49] * 4
    assert [seg.count(layer) for layer in range(4)] == [50] * 4
    assert (sender.pending, sender.failed, sender.running) == (0, 0, False)
    with pytest.raises(RuntimeError, match="^the kv signal sender is destroyed; enqueue refused$"):
        sender.enqueue(0, 99)
    seg.close()
    seg.unlink()


def test_sender_completion_kinds_and_bounded_waits():
    seg = _native.open_shm_and_get_meta_signal(ns.new_segment_name(_iid()), 3, True)
    sender = _native.create_kv_signal_sender(seg, 0.05)

    def boom():
        raise RuntimeError("cache write failed")

    sender.enqueue(0, 1, _native.CompletionFlag())  # never set: dropped after 0.05 s
    sender.enqueue(1, 1, lambda: True)              # a callable (e.g. Event.synchronize)
    sender.enqueue(2, 1, boom)                      # raises: dropped, reported
    sender.enqueue(2, 2)                            # None: complete already
    t0 = time.perf_counter()
    assert _native.destroy_kv_signal_sender(sender) == 2
    assert time.perf_counter() - t0 < 5.0
    assert [seg.step(layer) for layer in range(3)] == [-1, 1, 2]
    assert sender.failed == 2
    assert sender.last_error.startswith("layer 2 step 1: RuntimeError: cache write failed")
    with pytest.raises(TypeError, match=r"^completion must be None, a CompletionFlag, a callable.*, got str$"):
        _native.create_kv_signal_sender(seg, 1.0).enqueue(0, 1, "done")
    seg.close()
    seg.unlink()


def test_send_before_init_is_a_noop():
    iid = _iid()
    assert ns.send_signal(0, 1) is False
    assert ns.signal_stats() == {"written": 0, "suppressed_uninit": 1, "suppressed_profile": 0}
    sig = ns.NativeLayerSignaller(iid, 2)
    assert sig.signal(0, 1) is False and sig.stats["suppressed"] == 1 and _files(iid) == []
    ch = sig.init()
    assert ns.init_signal_layerwise(ch) is True
    assert ns.send_signal(1, 5) is True and ch.step(1) == 5
    ns.reset_signal_layerwise()
    assert ns.send_signal(1, 6) is False and ch.step(1) == 5
    assert ns.signal_stats() == {"written": 1, "suppressed_uninit": 2, "suppressed_profile": 0}
    sig.close()
    assert _files(iid) == []


def test_profile_run_creates_nothing_and_sends_nothing():
    iid = _iid()
    sig = ns.NativeLayerSignaller(iid, 2)
    with forward_context(is_dummy_or_profile_run=True):
        assert sig.init() is None and ns.NativeSignalChannel.create(iid, 2) is None
        assert _files(iid) == []
    ch = sig.init()
    assert ns.init_signal_layerwise(ch)
    with forward_context(is_dummy_or_profile_run=True):  # a dummy run after real traffic
        assert sig.signal(0, 1) is False and ns.send_signal(0, 1) is False and ch.signal(0, 1) is False
        assert ns.init_signal_layerwise(ch) is False
    _native.set_profile_run(True)  # the native switch gates alone too
    assert sig.signal(0, 1) is False and ns.send_signal(0, 1) is False
    assert ns.NativeSignalChannel.create(iid, 2) is None
    _native.set_profile_run(False)
    sig.flush()
    assert (ch.step(0), ch.count(0), sig.written) == (-1, 0, 0)
    assert ns.signal_stats()["suppressed_profile"] == 6  # 4 set-ups + 2 send_signal refused natively
    assert sig.stats == {"enqueued": 0, "suppressed": 2, "creates_suppressed": 1}
    sig.close()


def test_layerwise_transfer_with_the_native_sender():
    """P's "prefill" writes layer l's blocks, then sets that layer's completion; the native sender
    writes the signal; a LayerwiseWorker reading the segment copies the layer to D. D ends
    byte-identical to P in both layerwise and request mode."""
    from kvflow import KVCacheSpec, PagedKVCache
    from kvflow.kernels import copy_blocks
    from kvflow.connector.layerwise.scheduler import LayerwiseScheduler
    from kvflow.connector.layerwise.worker import LayerwiseWorker

    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    src_ids, dst_ids, tokens = [5, 1, 7], [0, 6, 2], 10
    results = {}
    for mode in ("layerwise", "request"):
        p, d = PagedKVCache(spec, 8), PagedKVCache(spec, 8)
        sig = ns.NativeLayerSignaller(_iid(), spec.num_layers)
        sig.init()
        done = threading.Event()
        sched = LayerwiseScheduler(spec.num_layers, spec.block_size, mode=mode, layerwise_min_tokens=0,
                                   send=lambda rid, layers, s, t: copy_blocks(p, d, s, t, layers=layers,
                                                                              backend="native"),
                                   on_done=lambda rid: done.set())
        sched.add_request("r0", tokens, src_ids)
        sched.set_dst_blocks("r0", dst_ids)
        g = torch.Generator().manual_seed(1)
        with LayerwiseWorker(sched, SignalReader(sig.name), poll_s=0.01, signal_timeout_s=10.0):
            for step, end in ((1, 6), (2, 10)):  # two prefill chunks
                sched.add_chunk("r0", step, end)
                for layer in range(spec.num_layers):
                    flag = ns.CompletionFlag()
                    sig.signal(layer, step, flag)
                    for t in p.layer(layer):  # the layer's KV write, then its completion
                        t.view(torch.uint8)[src_ids].copy_(
                            torch.randint(1, 256, t.view(torch.uint8)[src_ids].shape, dtype=torch.uint8, generator=g))
                    flag.set()
            assert done.wait(10.0), f"{mode}: the request did not finish"
        assert sig.close() == 2 * spec.num_layers
        for t_p, t_d in zip(p.tensors(), d.tensors()):
            assert torch.equal(t_d.view(torch.uint8)[dst_ids], t_p.view(torch.uint8)[src_ids])
        results[mode] = d.buffer.clone()
    assert torch.equal(results["layerwise"], results["request"])
