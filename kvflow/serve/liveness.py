"""Is an instance's process still running? A router on the same host (and pid namespace) as
an instance it did not start can see the answer at once, instead of waiting for heartbeats to
stop: a killed decode instance is then noticed within one monitor tick (0.1 s), not after
``--dead-after-s``. The same judgement decides when a peer's blocks may be reused (a P that
writes into D's blocks, a D that reads P's).

:func:`host_id` names this host and pid namespace (Linux: the kernel's boot id and the pid
namespace's inode); every instance sends it in :class:`~kvflow.protocol.Register`. Only when
the two ids are equal (and not empty) are pids comparable. The functions live in
:mod:`kvflow.segments`, which judges shared-memory segment owners by the same rule.
"""

from __future__ import annotations

from kvflow.segments import ALIVE, DEAD, UNKNOWN, host_id, process_exited, process_state

__all__ = ["ALIVE", "DEAD", "UNKNOWN", "host_id", "process_exited", "process_state"]
