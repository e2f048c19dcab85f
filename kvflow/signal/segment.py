"""The signal segment: one POSIX shared-memory file of per-layer completion slots.

Layout (fixed; ``xpu/``'s C++ sender writes the same bytes; all integers little-endian)
-------------------------------------------------------------------------------------
Name ``kvflow-sig-<instance_id>-<owner>-<16 random hex digits>`` under ``/dev/shm`` (``shm_open``
name ``/kvflow-sig-...``; the scheme of every kvflow segment, :mod:`kvflow.segments`, whose
owner part -- pid, start time, pid namespace, boot -- lets any process judge whether the owner
lives), created ``O_CREAT | O_EXCL``, mode ``0600``; the random part comes from
:func:`secrets.token_hex`, so a name cannot be guessed from the pid. File size
:func:`segment_bytes` = ``64 + 64 * num_layers`` rounded up to 4096 (a whole page, so the file
can be host-registered with CUDA); bytes past the last slot are zero.

==========  ======  ====================================================================
offset      type    field
==========  ======  ====================================================================
0           8 B     magic ``b"KVFSIG01"``
8           u32     version (= 1)
12          u32     num_layers
16          u64     owner_pid
24          u64     owner_start_time: field 22 of ``/proc/<pid>/stat`` (clock ticks after
                    boot), which tells a reused pid from the owner
32          u64     created_ns (``CLOCK_REALTIME`` nanoseconds)
40..63              zero
64 + 64*l   i64     slot ``l`` ``step``: the latest prefill step whose layer ``l`` KV is
                    complete; -1 until the first signal
72 + 64*l   i64     slot ``l`` ``count``: signals written to layer ``l`` (monotone)
80 + 64*l..         zero (each slot owns a 64-byte cache line)
==========  ======  ====================================================================

Ordering: the writer stores ``count`` first, then ``step`` with release semantics; the reader
loads ``step`` (acquire) and then may read ``count``. Both are naturally aligned 8-byte words,
so every load sees a whole value. The CPU writer here stores through an aligned numpy view
(one ``mov`` each; x86-64 keeps stores in program order, TSO); the GPU writer is
:mod:`kvflow.signal.triton_signal` (release at system scope).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time

import numpy as np

from kvflow import segments
from kvflow.segments import process_start_time  # noqa: F401 - part of this module's API

MAGIC = b"KVFSIG01"
VERSION = 1
HEADER_BYTES = 64
SLOT_BYTES = 64
SLOT_WORDS = SLOT_BYTES // 8
STEP_OFFSET = 0
COUNT_OFFSET = 8
PAGE_BYTES = 4096
SHM_DIR = "/dev/shm"
KIND = "sig"
PREFIX = "kvflow-sig-"
NAME_FORMAT = "kvflow-sig-<instance_id>-<owner>-<16 hex>"
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, num_layers, pid, start_time, created_ns
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")
MAX_LAYERS = 1 << 16


def is_segment_name(name: str) -> bool:
    """True for a signal segment name (with or without the leading ``/`` of shm_open)."""
    parsed = segments.parse_name(name.lstrip("/")) if isinstance(name, str) else None
    return parsed is not None and parsed.kind == KIND and bool(parsed.label) \
        and len(name.rsplit("-", 1)[1]) == 16


def segment_bytes(num_layers: int) -> int:
    """File size of a segment: ``64 + 64 * num_layers`` bytes rounded up to a 4096-byte page."""
    need = HEADER_BYTES + SLOT_BYTES * num_layers
    return -(-need // PAGE_BYTES) * PAGE_BYTES


def check_instance_id(instance_id: str) -> str:
    """``instance_id`` goes into a file name: 1-64 characters of ``[A-Za-z0-9_]``.

    Raises
    ------
    ValueError
        Naming the value, e.g. ``instance_id='p/0'``.
    """
    if not isinstance(instance_id, str) or not _INSTANCE_RE.match(instance_id):
        raise ValueError(f"instance_id must be 1-64 characters of [A-Za-z0-9_], got {instance_id!r}")
    return instance_id


def check_num_layers(num_layers: int) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 < num_layers <= MAX_LAYERS:
        raise ValueError(f"num_layers must be an int in 1..{MAX_LAYERS}, got {num_layers!r}")
    return num_layers


class Segment:
    """An open mapping of one signal segment (the creator's or an attached one).

    Use :meth:`create` or :meth:`attach`. ``words`` is an int64 numpy view of the whole file;
    ``slots`` the ``[num_layers, 8]`` view of the slots (column 0 = step, 1 = count).

    Attributes
    ----------
    name : str
        The ``shm_open`` name without the leading slash.
    path : str
        ``/dev/shm/<name>``.
    num_layers, owner_pid, owner_start_time, created_ns : int
        From the header.
    owner : bool
        True for the creator (which unlinks the file on :meth:`close`).
    """

    def __init__(self, path: str, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.owner = owner
        self._mm = mm
        magic, version, n, pid, start, created = _HEADER.unpack_from(mm, 0)
        self.num_layers, self.owner_pid = n, pid
        self.owner_start_time, self.created_ns = start, created
        self.words = np.frombuffer(mm, dtype=np.int64)
        self.slots = self.words[HEADER_BYTES // 8:HEADER_BYTES // 8 + n * SLOT_WORDS].reshape(n, SLOT_WORDS)
        self.closed = False

    @property
    def address(self) -> int:
        """Virtual address of byte 0 of the mapping in this process."""
        return int(self.words.ctypes.data)

    @property
    def nbytes(self) -> int:
        return len(self._mm)

    @classmethod
    def create(cls, instance_id: str, num_layers: int, *, shm_dir: str = SHM_DIR) -> "Segment":
        """Create a fresh segment owned by this process (every slot ``step = -1, count = 0``).

        Raises
        ------
        ValueError
            Bad ``instance_id`` or ``num_layers`` (naming the value).
        OSError
            If ``/dev/shm`` cannot be written.
        """
        check_instance_id(instance_id)
        check_num_layers(num_layers)
        size = segment_bytes(num_layers)
        name, fd = segments.create(KIND, size, label=instance_id, nhex=16, shm_dir=shm_dir)
        path = os.path.join(shm_dir, name)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        pid = os.getpid()
        _HEADER.pack_into(mm, 0, MAGIC, VERSION, num_layers, pid, process_start_time(pid) or 0,
                          time.time_ns())
        words = np.frombuffer(mm, dtype=np.int64)
        slots = words[HEADER_BYTES // 8:].reshape(-1, SLOT_WORDS)[:num_layers]
        slots[:, STEP_OFFSET // 8] = -1
        del words, slots
        return cls(path, mm, owner=True)

    @classmethod
    def attach(cls, name: str, *, num_layers: int | None = None, writable: bool = False,
               shm_dir: str = SHM_DIR) -> "Segment":
        """Map an existing segment by name (e.g. in the transfer worker's process).

        Raises
        ------
        ValueError
            ``name`` is not a kvflow signal segment name, the file is too short, its magic or
            version is wrong, or ``num_layers`` is given and differs from the header's.
        FileNotFoundError
            No such segment.
        """
        if not isinstance(name, str) or not is_segment_name(name):
            raise ValueError(f"name must look like {NAME_FORMAT!r}, got {name!r}")
        path = os.path.join(shm_dir, name.lstrip("/"))
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"segment {name!r} holds {size} bytes, less than its 64-byte header")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        magic, version, n, *_ = _HEADER.unpack_from(mm, 0)
        problem = None
        if magic != MAGIC:
            problem = f"magic is {magic!r}, expected {MAGIC!r}"
        elif version != VERSION:
            problem = f"version is {version}, expected {VERSION}"
        elif size < HEADER_BYTES + SLOT_BYTES * n:
            problem = f"holds {size} bytes, too few for {n} layers"
        elif num_layers is not None and n != num_layers:
            problem = f"has num_layers={n}, expected num_layers={num_layers}"
        if problem:
            mm.close()
            raise ValueError(f"segment {name!r} {problem}")
        return cls(path, mm, owner=False)

    def close(self) -> None:
        """Unmap; the owner also unlinks the file. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.words = self.slots = None  # drop the buffer exports before closing the map
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the map goes with it
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, num_layers={self.num_layers}, owner={self.owner})"


def cleanup_stale(*, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the segments of dead owners -- signal segments and every other kvflow kind
    (:func:`kvflow.segments.clean_stale`: the owner is judged from the name; those of live
    owners, of other pid namespaces or boots, and unparseable names are left alone).

    Returns
    -------
    list of str
        Names removed.
    """
    return segments.clean_stale(shm_dir)
