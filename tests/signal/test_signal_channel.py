"""Signal channel: writes, bounded waits, the Triton signal kernel, and another process."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time

import pytest

from kvflow.signal import SignalChannel, SignalReader, cleanup_stale
from kvflow.signal.segment import SHM_DIR


def _iid() -> str:
    return "t_" + secrets.token_hex(4)


def test_signal_then_wait_returns_step_and_counts():
    with SignalChannel.create(_iid(), 4) as ch, SignalReader(ch.name, num_layers=4) as r:
        assert ch.signal(3, 0) and ch.signal(3, 4) and ch.signal(0, 2)
        assert r.wait(3, 4, timeout_s=0.0) == 4
        assert r.wait(3, 1, timeout_s=0.0) == 4  # a later step satisfies an earlier one
        assert r.steps().tolist() == [2, -1, -1, 4]
        assert [r.count(i) for i in range(4)] == [1, 0, 0, 2]
        assert ch.stats.written == 3


def test_missing_writer_times_out_within_bound_naming_layer_step_segment():
    with SignalChannel.create(_iid(), 3) as ch:
        ch.signal(2, 1)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as e:
            SignalReader(ch.name).wait(2, 3, timeout_s=0.2)
        took = time.perf_counter() - t0
    assert 0.2 <= took < 1.5
    assert str(e.value) == (f"no signal for layer 2 of step 3 on segment '{ch.name}' within 0.2 s "
                            f"(layer 2 last completed step 1, 1 signals so far)")


def test_step_must_not_decrease_and_bad_layer():
    with SignalChannel.create(_iid(), 2) as ch:
        ch.signal(0, 5)
        with pytest.raises(ValueError, match=r"^step=4 is older than layer 0's last signalled step 5; "
                                             r"steps must not decrease$"):
            ch.signal(0, 4)
        with pytest.raises(ValueError, match=r"^layer must be an int in \[0, 2\), got 2$"):
            ch.signal(2, 6)
        with pytest.raises(ValueError, match=r"^step must be a non-negative int, got -1$"):
            ch.signal(1, -1)
        assert ch.steps().tolist() == [5, -1] and ch.count(0) == 1


INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor path of Triton's interpreter; the GPU test covers CUDA")


@INTERPRETED
def test_triton_signal_kernel_stores_step_and_count():
    from kvflow.signal.triton_signal import signal_layer
    with SignalChannel.create(_iid(), 3) as ch:
        words = ch._words
        signal_layer(words, 1, 7, num_layers=3)
        signal_layer(words, 1, 8, num_layers=3)
        signal_layer(words, 2, 1, num_layers=3)
        assert ch.steps().tolist() == [-1, 8, 1]
        assert [ch.count(i) for i in range(3)] == [0, 2, 1]
        with pytest.raises(ValueError, match=r"^layer must be an int in \[0, 3\), got 3$"):
            signal_layer(words, 3, 1, num_layers=3)
        with pytest.raises(ValueError, match=r"^store must be one of \('atomic', 'asm'\), got 'x'$"):
            signal_layer(words, 0, 1, num_layers=3, store="x")


def _child(parent_name: str, conn) -> None:
    """Spawned: read the parent's stores, then write its own (CPU store and the Triton kernel,
    interpreted) and die without cleaning up."""
    from kvflow.signal.triton_signal import signal_layer
    r = SignalReader(parent_name)
    conn.send("attached")
    try:
        seen = r.wait(2, 5, timeout_s=30)
        conn.send(("seen", seen, r.count(2)))
    except TimeoutError as e:
        conn.send(("timeout", str(e)))
    ch = SignalChannel.create("t_child", 3, cleanup=False)
    conn.send(ch.name)
    if conn.poll(30):
        conn.recv()
        ch.signal(0, 11)
        signal_layer(ch._words, 1, 12, num_layers=3)
        conn.poll(30)
    os._exit(0)  # no finalizers: the segment is left behind with a dead owner


@INTERPRETED
def test_writer_and_reader_in_different_processes_and_stale_cleanup():
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    with SignalChannel.create(_iid(), 3) as ch:
        proc = ctx.Process(target=_child, args=(ch.name, child_conn))
        proc.start()
        try:
            assert parent_conn.poll(60) and parent_conn.recv() == "attached"
            ch.signal(2, 5)
            assert parent_conn.poll(30) and parent_conn.recv() == ("seen", 5, 1)
            assert parent_conn.poll(30)
            child_name = parent_conn.recv()
            with SignalReader(child_name, num_layers=3) as r:
                parent_conn.send("go")
                assert r.wait(0, 11, timeout_s=30) == 11
                assert r.wait(1, 12, timeout_s=30) == 12
                assert [r.count(i) for i in range(3)] == [1, 1, 0]
                parent_conn.send("done")
            proc.join(30)
            assert proc.exitcode == 0
        finally:
            if proc.is_alive():
                proc.kill()
        assert os.path.exists(os.path.join(SHM_DIR, child_name))  # its owner died uncleanly
        assert child_name in cleanup_stale()
        assert not os.path.exists(os.path.join(SHM_DIR, child_name))
        assert os.path.exists(ch.segment.path)  # the live owner's segment stays


def _reader_child(name: str, layer: int, step: int, conn) -> None:
    """Spawned: wait for one signal and report the step and count seen (or the timeout)."""
    try:
        with SignalReader(name) as r:
            conn.send((r.wait(layer, step, timeout_s=30), r.count(layer)))
    except TimeoutError as e:
        conn.send(str(e))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("store", ["atomic", "asm"])
def test_gpu_signal_kernel_visible_to_another_process(store):
    import torch
    ctx = mp.get_context("spawn")
    with SignalChannel.create(_iid(), 4, device="cuda", store=store) as ch:
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_reader_child, args=(ch.name, 3, 9, b))
        proc.start()
        x = torch.ones(1 << 20, device="cuda")
        for step in range(1, 10):
            x.mul_(1.0001)  # stream-ordered work before the signal
            assert ch.signal(3, step)
        torch.cuda.synchronize()
        assert ch.steps().tolist() == [-1, -1, -1, 9] and ch.count(3) == 9
        assert a.poll(60) and a.recv() == (9, 9)
        proc.join(30)
        assert proc.exitcode == 0
