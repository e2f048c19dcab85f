"""Shared-memory segments (issue 14 kind 6), all owned by kvflow/segments.py: (a) a segment
larger than the free space of /dev/shm is refused at creation naming both sizes and the flags
that lower it, and every segment's pages are reserved (no SIGBUS later); (b) stale-segment
clean-up judges an owner by boot id + pid namespace + pid + start time and leaves what it
cannot judge (another pid namespace, another boot, older names); (d) every kind of segment is
named, created and judged by that one module. (c), signal segments of a killed P removed when
the server stops, is checked end to end in tests/serve/test_serve_faults.py."""

from __future__ import annotations

import errno
import os
import pathlib
import re
import secrets
import subprocess
import sys

import pytest
import torch

from kvflow import KVCacheSpec, segments
from kvflow.segments import DEAD, SHM_DIR, Owner, SegmentSpaceError
from kvflow.connector.transport.shm import SharedCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def _mine(kind: str) -> set[str]:
    prefix = f"kvflow-{kind}-{Owner.me().tag}-"
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


# ---- (a) capacity --------------------------------------------------------------------------
def test_cache_larger_than_free_shared_memory_is_refused_naming_sizes_and_flags(monkeypatch):
    monkeypatch.setattr(segments, "free_bytes", lambda directory: 10_000)
    before = _mine("decode")
    SharedCache(SPEC, 8, role="decode").close()  # 8 x 1024 bytes fit in 10000
    with pytest.raises(SegmentSpaceError) as e:
        SharedCache(SPEC, 16, role="decode")
    assert str(e.value) == (
        f"[Errno 28] the decode instance's KV cache (16 blocks x 1024 bytes) needs 16384 bytes "
        f"(0.0 MiB) of shared memory but {SHM_DIR} has 10000 bytes (0.0 MiB) free: lower "
        f"--num-blocks or --memory-budget-mb, or give {SHM_DIR} more space (docker run --shm-size)")
    assert _mine("decode") == before  # nothing left behind


def test_space_taken_between_check_and_reservation_is_the_same_error(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    before = _mine("prefill")
    with pytest.raises(SegmentSpaceError, match=r"^\[Errno 28\] the prefill instance's KV cache "
                                                r"\(4 blocks x 1024 bytes\) needs 4096 bytes"):
        SharedCache(SPEC, 4)
    assert _mine("prefill") == before


def test_every_page_of_a_segment_is_reserved_at_creation():
    """posix_fallocate, not a sparse ftruncate: the pages exist before anyone writes them, so
    a full /dev/shm cannot SIGBUS a running server."""
    from kvflow.signal import SignalChannel
    cache = SharedCache(SPEC, 64)
    try:
        st = os.stat(cache.path)
        assert st.st_size == 64 * 1024 and st.st_blocks * 512 >= st.st_size
    finally:
        cache.close()
    with SignalChannel.create("t_" + secrets.token_hex(4), 3) as ch:
        st = os.stat(ch.segment.path)
        assert st.st_size == 4096 and st.st_blocks * 512 >= 4096


# ---- (b) judging owners ----------------------------------------------------------------------
def _fake(kind: str, owner: Owner | None = None, legacy_pid: int | None = None) -> str:
    name = (f"kvflow-{kind}-{legacy_pid}-{secrets.token_hex(6)}" if owner is None else
            f"kvflow-{kind}-{owner.tag}-{secrets.token_hex(6)}")
    pathlib.Path(SHM_DIR, name).write_bytes(b"\0" * 64)
    return name


def test_clean_up_judges_boot_pid_namespace_pid_and_start_time_and_leaves_the_unjudgeable():
    me = Owner.me()
    nobody = int(open("/proc/sys/kernel/pid_max").read()) + 1   # no process has this pid
    ppid = os.getppid()
    start = segments.process_start_time(ppid)
    cases = {
        "dead": (Owner(nobody, 5, me.pid_ns, me.boot), True),
        "pid reused": (Owner(ppid, start + 1, me.pid_ns, me.boot), True),
        "live": (Owner(ppid, start, me.pid_ns, me.boot), False),
        # a server in another container sharing /dev/shm: its pids are not ours to judge
        "other pid namespace": (Owner(nobody, 5, me.pid_ns + 1, me.boot), False),
        "other boot": (Owner(nobody, 5, me.pid_ns, "0123456789ab"), False),
    }
    names = {(why, kind): _fake(kind, owner) for why, (owner, _) in cases.items()
             for kind in ("prefill", "decode", "cudaipc")}
    names["older name", "prefill"] = _fake("prefill", legacy_pid=nobody)  # pid only: unjudgeable
    try:
        removed = set(segments.clean_stale())
        for (why, kind), name in names.items():
            gone = cases.get(why, (None, False))[1]
            assert (name in removed) == gone, (why, kind)
            assert os.path.exists(os.path.join(SHM_DIR, name)) != gone, (why, kind)
    finally:
        for name in names.values():
            pathlib.Path(SHM_DIR, name).unlink(missing_ok=True)


def test_unlink_own_removes_this_process_s_segments_of_every_kind_and_no_other(tmp_path):
    me = Owner.me()
    ppid = os.getppid()
    owners = {"mine": me, "parent's": Owner(ppid, segments.process_start_time(ppid), me.pid_ns,
                                            me.boot),
              "reused pid": Owner(me.pid, me.start_time + 1, me.pid_ns, me.boot)}
    names = {(why, kind): f"kvflow-{kind}-{owner.tag}-{secrets.token_hex(6)}"
             for why, owner in owners.items() for kind in ("prefill", "decode", "sig")}
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 64)
    mine = sorted(n for (why, _), n in names.items() if why == "mine")
    assert segments.unlink_own(str(tmp_path)) == mine
    assert sorted(os.listdir(tmp_path)) == sorted(set(names.values()) - set(mine))
    assert segments.unlink_own(str(tmp_path)) == []


def test_router_keeps_the_segment_of_an_instance_it_cannot_judge():
    """An instance in another pid namespace declared dead (missed heartbeats) keeps its
    segment: the router judged it by a pid that means nothing here and unlinked it."""
    from kvflow.serve.protocol import Register
    from kvflow.serve.router.control import Controller, InstanceInfo
    me = Owner.me()
    nobody = int(open("/proc/sys/kernel/pid_max").read()) + 1
    foreign = _fake("decode", Owner(nobody, 5, me.pid_ns + 1, me.boot))
    dead = _fake("decode", Owner(nobody, 5, me.pid_ns, me.boot))
    ctl = Controller()
    try:
        for name in (foreign, dead):
            reg = Register(instance_id="d-1", role="decode", spec={}, num_blocks=1, free_blocks=1,
                           max_model_len=16, kv_connector="ipc-pull", pid=nobody, shm_name=name,
                           host_id="elsewhere")
            ctl.instance_died(InstanceInfo(reg, b"d-1", 0.0, 1), "missed heartbeats")
        assert os.path.exists(os.path.join(SHM_DIR, foreign))
        assert not os.path.exists(os.path.join(SHM_DIR, dead))
    finally:
        ctl.sock.close(0)
        ctl.ctx.term()
        pathlib.Path(SHM_DIR, foreign).unlink(missing_ok=True)


def test_process_state_judges_only_peers_of_this_host_and_pid_namespace():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    here = segments.host_id()
    assert segments.process_state(os.getpid(), here) == segments.ALIVE
    assert segments.process_state(child.pid, here) == DEAD
    assert segments.process_state(child.pid, "another-boot/1") == segments.UNKNOWN
    assert segments.process_state(child.pid, "") == segments.UNKNOWN
    assert segments.process_state(0, here) == segments.UNKNOWN


# ---- (d) one module --------------------------------------------------------------------------
def test_every_segment_kind_is_named_created_and_judged_by_kvflow_segments():
    from kvflow.signal import SignalChannel
    from kvflow.connector.transport.cuda_ipc import CudaIpcExport, publish_export, read_export
    exp = CudaIpcExport(uuid="u", pci_bus_id="", handle=b"h", storage_size=1, storage_offset=0,
                        ref_counter_handle=b"", ref_counter_offset=0, event_handle=b"",
                        event_sync_required=False, buffer_offset=0, nbytes=1, num_blocks=1,
                        spec={}, pid=os.getpid())
    caches = [SharedCache(SPEC, 2, role=r) for r in ("prefill", "decode")]
    published = publish_export(exp, role="decodecuda")
    chan = SignalChannel.create("p_1_ab", 2)
    try:
        assert read_export(published) == exp
        names = [c.name for c in caches] + [published, chan.name]
        parsed = [segments.parse_name(n) for n in names]
        assert [p.kind for p in parsed] == ["prefill", "decode", "decodecuda", "sig"]
        assert all(p.owner == Owner.me() for p in parsed) and parsed[3].label == "p_1_ab"
        for n in names:
            assert os.stat(os.path.join(SHM_DIR, n)).st_mode & 0o777 == 0o600
            assert segments.owner_state(segments.parse_name(n).owner) == segments.ALIVE
    finally:
        for c in caches:
            c.close()
        segments.unlink(published)
        chan.close()


def test_no_other_module_creates_segments_or_judges_processes():
    """Names, creation (O_EXCL), clean-up and liveness (os.kill(pid, 0), /proc/<pid>/stat)
    live in kvflow/segments.py only; the other modules call it."""
    root = pathlib.Path(__file__).resolve().parents[1] / "kvflow"
    pattern = re.compile(r"os\.O_EXCL|os\.kill\([^,]+,\s*0\)|/proc/\{|f\"kvflow-\{")
    offenders = [f"{path.relative_to(root)}:{i}" for path in sorted(root.rglob("*.py"))
                 if path.name != "segments.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line.split("#")[0])]
    assert offenders == []
