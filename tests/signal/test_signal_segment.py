"""The signal segment: byte layout, names, mode, removal, stale cleanup."""

from __future__ import annotations

import os
import secrets
import stat
import struct

import numpy as np
import pytest

from kvflow.segments import Owner
from kvflow.signal import MAGIC, Segment, SignalChannel, SignalReader, cleanup_stale, segment_bytes
from kvflow.signal.segment import SHM_DIR, process_start_time


def _iid() -> str:
    return "t_" + secrets.token_hex(4)


def _fake_segment(pid: int, start: int, *, magic: bytes = MAGIC, num_layers: int = 2) -> str:
    """Write a segment file with a chosen owner (name and header); return its name."""
    me = Owner.me()
    owner = Owner(pid, start, me.pid_ns, me.boot)
    name = f"kvflow-sig-{_iid()}-{owner.tag}-{secrets.token_hex(8)}"
    head = struct.pack("<8sIIQQQ", magic, 1, num_layers, pid, start, 0).ljust(64, b"\0")
    with open(os.path.join(SHM_DIR, name), "xb") as f:
        f.write(head + b"\0" * (segment_bytes(num_layers) - 64))
    return name


def test_header_and_slots_bytes():
    with SignalChannel.create(_iid(), 3) as ch:
        raw = open(ch.segment.path, "rb").read()
        assert len(raw) == 4096 == segment_bytes(3)
        magic, version, n, pid, start, created = struct.unpack_from("<8sIIQQQ", raw, 0)
        assert (magic, version, n, pid) == (b"KVFSIG01", 1, 3, os.getpid())
        assert start == process_start_time(os.getpid()) and start > 0
        assert created > 0 and raw[40:64] == b"\0" * 24
        slots = np.frombuffer(raw[64:64 + 3 * 64], dtype="<i8").reshape(3, 8)
        assert slots[:, 0].tolist() == [-1, -1, -1] and not slots[:, 1:].any()
        ch.signal(1, 9)
        ch.signal(1, 10)
        raw = open(ch.segment.path, "rb").read()
        assert struct.unpack_from("<qq", raw, 64 + 64) == (10, 2)  # slot 1: step, count
        assert struct.unpack_from("<qq", raw, 64) == (-1, 0)
        assert raw[64 + 3 * 64:] == b"\0" * (4096 - 64 - 3 * 64)


def test_names_unique_mode_0600_and_removed_on_close():
    iid = _iid()
    chans = [SignalChannel.create(iid, 1) for _ in range(3)]
    names = [c.name for c in chans]
    assert len(set(names)) == 3
    for c in chans:
        assert c.name.startswith(f"kvflow-sig-{iid}-") and len(c.name.rsplit("-", 1)[1]) == 16
        assert stat.S_IMODE(os.stat(c.segment.path).st_mode) == 0o600
    for c in chans:
        c.close()
        c.close()  # idempotent
        assert not os.path.exists(c.segment.path)


def test_removed_when_garbage_collected():
    ch = SignalChannel.create(_iid(), 1)
    path = ch.segment.path
    del ch
    import gc
    gc.collect()
    assert not os.path.exists(path)


def test_cleanup_removes_dead_and_reused_pid_keeps_live_and_unwritten():
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    dead = _fake_segment(pid_max + 1, 123)  # no process can have this pid
    reused = _fake_segment(os.getpid(), process_start_time(os.getpid()) + 1)  # pid reuse
    ppid = os.getppid()
    live = _fake_segment(ppid, process_start_time(ppid))
    # a live owner's segment whose header is not written yet (being created): judged by name
    unwritten = _fake_segment(ppid, process_start_time(ppid), magic=b"\0" * 8)
    try:
        with SignalChannel.create(_iid(), 2) as mine:  # create() cleans first
            left = set(os.listdir(SHM_DIR))
            assert dead not in left and reused not in left
            assert {live, unwritten, mine.name} <= left
            assert cleanup_stale() == []  # nothing stale of ours left
    finally:
        for n in (live, unwritten):
            os.unlink(os.path.join(SHM_DIR, n))


@pytest.mark.parametrize("name, message", [
    ("../etc/passwd", "name must look like 'kvflow-sig-<instance_id>-<owner>-<16 hex>', got '../etc/passwd'"),
    ("kvflow-sig-x-0123", "name must look like 'kvflow-sig-<instance_id>-<owner>-<16 hex>', got 'kvflow-sig-x-0123'"),
    ("kvflow-sig-x-0123456789abcdef", "name must look like 'kvflow-sig-<instance_id>-<owner>-<16 hex>', "
                                      "got 'kvflow-sig-x-0123456789abcdef'"),  # the older scheme
])
def test_attach_rejects_bad_names(name, message):
    with pytest.raises(ValueError) as e:
        SignalReader(name)
    assert str(e.value) == message


def test_attach_checks_magic_and_layers():
    bad = _fake_segment(os.getpid(), 0, magic=b"NOTKVF01")
    try:
        with pytest.raises(ValueError, match=rf"segment '{bad}' magic is b'NOTKVF01', expected b'KVFSIG01'"):
            Segment.attach(bad)
    finally:
        os.unlink(os.path.join(SHM_DIR, bad))
    with SignalChannel.create(_iid(), 4) as ch:
        with pytest.raises(ValueError, match=rf"segment '{ch.name}' has num_layers=4, expected num_layers=5"):
            SignalReader(ch.name, num_layers=5)
    with pytest.raises(FileNotFoundError):
        SignalReader(ch.name)  # removed on close


@pytest.mark.parametrize("kwargs, message", [
    (dict(instance_id="p/0", num_layers=2), "instance_id must be 1-64 characters of [A-Za-z0-9_], got 'p/0'"),
    (dict(instance_id="p0", num_layers=0), "num_layers must be an int in 1..65536, got 0"),
    (dict(instance_id="p0", num_layers=2, device="meta"), "device must be a CPU or CUDA device, got 'meta'"),
    (dict(instance_id="p0", num_layers=2, store="plain"), "store must be 'atomic' or 'asm', got 'plain'"),
])
def test_create_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as e:
        SignalChannel.create(**kwargs)
    assert str(e.value) == message
