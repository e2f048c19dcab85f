"""kvflow's shared-memory segments and process liveness, in one place: how segments are named,
created, judged and cleaned up, and how one process tells whether another still runs. No torch
import: the router uses it.

Every segment is a file under :data:`SHM_DIR` named ::

    kvflow-<kind>-[<label>-]<pid>.<start>.<pidns>.<boot>-<random hex>

``kind``: ``prefill``/``decode`` (a paged KV cache), ``prefillcuda``/``decodecuda`` (a CUDA IPC
export record), ``sig`` (a signal segment); ``label``: optional (signal segments: the instance
id); the owner part: pid, start time (``/proc/<pid>/stat`` field 22), pid namespace inode and
the first 12 hex digits of the boot id; 12-16 random hex digits keep names unguessable.

A segment is stale when its owner is *dead*: same boot and pid namespace as the judge, and no
process with that pid, a zombie, or another start time (pid reused). Owners in another pid
namespace or boot, and names without an owner part, cannot be judged and are left alone
(:func:`clean_stale`). :func:`process_state` judges peers by the same rule, by
:func:`host_id`. :func:`create` makes segments mode 0600 with every page reserved, so a full
``/dev/shm`` is one :class:`SegmentSpaceError` at start-up, never a SIGBUS mid-request.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import re
import secrets

log = logging.getLogger("kvflow.segments")

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"

_NAME = re.compile(r"^kvflow-(?P<kind>[a-z]+)-(?:(?P<label>[A-Za-z0-9_]{1,64})-)?"
                   r"(?P<pid>\d{1,10})\.(?P<start>\d{1,20})\.(?P<ns>\d{1,20})\.(?P<boot>[0-9a-f]{12})"
                   r"-(?P<rand>[0-9a-f]{12,16})$")
_KIND = re.compile(r"^[a-z]+$")
_LABEL = re.compile(r"^[A-Za-z0-9_]{1,64}$")
NAME_FORMAT = "kvflow-<kind>-[<label>-]<pid>.<start>.<pidns>.<boot>-<hex>"


class SegmentSpaceError(OSError):
    """A segment does not fit in the free space of its file system (``/dev/shm``)."""


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def host_id() -> str:
    """``"<boot id>/<pid namespace inode>"`` of this process, or ``""`` where /proc does not
    tell (not Linux). Two processes can compare pids only when their host ids are equal."""
    boot, ns = _boot_id(), _pid_ns()
    return f"{boot}/{ns}" if boot and ns else ""


def _stat(pid: int | str) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after comm, which may hold spaces and ')'), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22), or None
    if no such process exists (or /proc cannot tell)."""
    rest = _stat(pid)
    return int(rest[19]) if rest else None  # field 22 is index 19


def process_exited(pid: int) -> bool:
    """True when ``pid`` (in this pid namespace) has exited: no such process, or a zombie
    nobody has reaped yet (its sockets and mappings are gone). False while it runs, or when
    unsure."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it exists
    rest = _stat(pid)
    return bool(rest) and rest[0] == b"Z"


def process_tree(pid: int) -> set[int]:
    """``pid`` and the pids of every live process below it (parents read from
    ``/proc/<pid>/stat`` field 4; a served instance starts a session of its own, so its
    process group does not hold it). Only ``{pid}`` where /proc cannot tell."""
    parent: dict[int, int] = {}
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        names = []
    for name in names:
        rest = _stat(name)
        if rest and rest[0] not in (b"Z", b"X"):
            parent[int(name)] = int(rest[1])
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in tree}
        tree |= frontier
    return tree


def process_state(pid: int, peer_host_id: str) -> str:
    """:data:`ALIVE`, :data:`DEAD` or :data:`UNKNOWN` for process ``pid`` of a peer whose
    :func:`host_id` is ``peer_host_id``: judged only when the host ids are equal (and known)."""
    if pid <= 0 or not peer_host_id or peer_host_id != host_id():
        return UNKNOWN
    return DEAD if process_exited(pid) else ALIVE


@dataclasses.dataclass(frozen=True)
class Owner:
    """The process that created a segment, as its name records it."""

    pid: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    pid_ns: int      # inode of the owner's pid namespace
    boot: str        # first 12 hex digits of the owner's kernel boot id

    @property
    def tag(self) -> str:
        return f"{self.pid}.{self.start_time}.{self.pid_ns}.{self.boot}"

    @classmethod
    def me(cls) -> "Owner":
        """This process (``boot`` is 12 zeros and ``pid_ns`` 0 where /proc does not tell:
        nobody can judge such an owner, so its segments are never removed by others)."""
        pid = os.getpid()
        boot = _boot_id().replace("-", "")[:12] or "0" * 12
        return cls(pid, process_start_time(pid) or 0, _pid_ns(), boot)


def owner_state(owner: Owner) -> str:
    """:data:`ALIVE`, :data:`DEAD` (no such process, a zombie, or another start time: the pid
    was reused) or :data:`UNKNOWN` (another boot or pid namespace, or this host's ids unknown)."""
    me = Owner.me()
    if not me.pid_ns or me.boot == "0" * 12 or (owner.boot, owner.pid_ns) != (me.boot, me.pid_ns):
        return UNKNOWN
    if process_exited(owner.pid) or process_start_time(owner.pid) != owner.start_time:
        return DEAD
    return ALIVE


@dataclasses.dataclass(frozen=True)
class SegmentName:
    """A parsed segment name."""

    kind: str
    label: str
    owner: Owner


def new_name(kind: str, label: str = "", *, nhex: int = 12) -> str:
    """A fresh segment name of ``kind`` owned by this process (see the module docstring).
    Raises ValueError: ``kind`` not lowercase letters, ``label`` not 1-64 of ``[A-Za-z0-9_]``,
    ``nhex`` not in 12..16 (each named with its value)."""
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise ValueError(f"kind must be lowercase letters, got {kind!r}")
    if label and not (isinstance(label, str) and _LABEL.match(label)):
        raise ValueError(f"label must be 1-64 characters of [A-Za-z0-9_], got {label!r}")
    if not 12 <= nhex <= 16:
        raise ValueError(f"nhex must be in 12..16, got {nhex!r}")
    middle = f"{label}-" if label else ""
    return f"kvflow-{kind}-{middle}{Owner.me().tag}-{secrets.token_hex(8)[:nhex]}"


def parse_name(name: str) -> SegmentName | None:
    """The parts of a kvflow segment name, or None for any other name (also older ones)."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        return None
    owner = Owner(int(m["pid"]), int(m["start"]), int(m["ns"]), m["boot"])
    return SegmentName(m["kind"], m["label"] or "", owner)


def segment_path(name: str, shm_dir: str | None = None) -> str:
    """Path of segment ``name``. Raises ValueError when ``name`` is not a kvflow segment name
    (it never reaches the file system)."""
    if parse_name(name) is None:
        raise ValueError(f"shm_name must look like {NAME_FORMAT!r}, got {name!r}")
    return os.path.join(shm_dir or SHM_DIR, name)


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _space_error(what: str, nbytes: int, free: int, directory: str, hint: str) -> SegmentSpaceError:
    fix = f"{hint}, or give {directory} more space" if hint else f"give {directory} more space"
    return SegmentSpaceError(
        errno.ENOSPC, f"{what} needs {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of shared memory "
        f"but {directory} has {free} bytes ({free / 2**20:.1f} MiB) free: {fix} (docker run "
        f"--shm-size)")


def create(kind: str, nbytes: int, *, label: str = "", nhex: int = 12, what: str = "",
           hint: str = "", shm_dir: str | None = None) -> tuple[str, int]:
    """Create a new segment of ``nbytes`` bytes owned by this process: ``O_CREAT | O_EXCL``,
    mode exactly 0600, every page reserved (``posix_fallocate``; a later write can never
    SIGBUS for want of space). Returns ``(name, fd)``; the caller closes ``fd``.

    Parameters
    ----------
    kind, label, nhex
        As :func:`new_name`.
    nbytes : int
        Size in bytes (> 0).
    what, hint : str
        For the out-of-space error: what the segment holds, how to make it smaller (flags).

    Raises
    ------
    SegmentSpaceError
        ``nbytes`` exceeds the free space of ``shm_dir`` (checked first), or the reservation
        failed for want of space; the message gives the size, the free bytes and ``hint``.
        Nothing is left behind.
    """
    directory = shm_dir or SHM_DIR
    name = new_name(kind, label, nhex=nhex)
    what = what or f"a kvflow-{kind} segment"
    free = free_bytes(directory)
    if nbytes > free:
        raise _space_error(what, nbytes, free, directory, hint)
    path = segment_path(name, directory)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may only remove bits; make the mode exact
        os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise _space_error(what, nbytes, free_bytes(directory), directory, hint) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # not every fs reserves
                raise
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return name, fd


def unlink(name: str, shm_dir: str | None = None) -> bool:
    """Remove segment ``name`` if it exists; True when something was removed."""
    try:
        os.unlink(segment_path(name, shm_dir))
        return True
    except FileNotFoundError:
        return False


def unlink_own(shm_dir: str | None = None) -> list[str]:
    """Unlink every kvflow segment (all kinds) this process created (:meth:`Owner.me`);
    returns the names removed. An instance calls it last on its way out, so that ``os._exit``
    (no finalizers) leaves nothing in /dev/shm."""
    me = Owner.me()
    return _unlink_where(lambda owner: owner == me, shm_dir)


def clean_stale(shm_dir: str | None = None) -> list[str]:
    """Unlink every kvflow segment (all kinds) whose owner is judged dead; leave live owners'
    and those that cannot be judged. Returns the names removed."""
    removed = _unlink_where(lambda owner: owner_state(owner) == DEAD, shm_dir)
    if removed:
        log.info("removed stale shared-memory segments of dead owners: %s", removed)
    return removed


def _unlink_where(owned, shm_dir: str | None) -> list[str]:
    """Unlink the kvflow segments whose owner satisfies ``owned(owner)``; the names removed."""
    directory = shm_dir or SHM_DIR
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    return [e for e in entries  # one gone meanwhile is skipped
            if (p := parse_name(e)) is not None and owned(p.owner) and unlink(e, directory)]
