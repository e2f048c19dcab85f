"""kvflow.segments: which host and pid namespace this is, and whether a pid has exited
(a zombie counts as exited: its sockets are closed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvflow.segments import host_id, process_exited


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs Linux /proc")
def test_host_id_is_boot_id_and_pid_namespace():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert host_id() == f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    out = subprocess.run([sys.executable, "-c", "from kvflow.segments import host_id; "
                          "print(host_id())"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == host_id()  # another process on this host: the same id


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_process_exited_for_running_zombie_and_reaped():
    assert process_exited(os.getpid()) is False
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_exited(proc.pid) is False
        proc.kill()
        deadline = time.monotonic() + 5
        while not process_exited(proc.pid):       # killed, not reaped yet: a zombie
            assert time.monotonic() < deadline, "a killed child never looked exited"
            time.sleep(0.01)
        with open(f"/proc/{proc.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        proc.kill()
        proc.wait()
    assert process_exited(proc.pid) is True      # reaped: no such process
