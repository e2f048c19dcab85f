"""Bad block ids found by a kernel on the device, reported without a device sync per call.

Block ids that live on a GPU are checked by the copy kernel itself (``validate=True``, the
default): an id outside ``[-1, num_blocks)`` is skipped (nothing outside the cache is written),
a destination id that repeats within one call is flagged, and the first such finding (first in
time, one per device until reported) is written to this device's error record. Reading ids on
the host instead would cost one device->host copy and a sync per call (issue #16 measured
109 us per default gather on an H200, against 9 us for a bare launch).

When it is reported (the documented points):

- by :func:`check_errors`, which waits for the device and raises; or
- by the next op called with device ids on that device once the faulty kernel has run: each
  call reads a page-locked host word that the kernel sets (no sync), and raises before it
  launches anything.

Record layout (int64, on the device): ``[lock, code, index, value, num_blocks]``; ``code`` is
``op * 16 + side * 4 + kind`` with op 1/2/3 = gather/scatter/copy, side 0/1 = source/destination
ids, kind 0 = out of range, 1 = a repeated destination block, 2 = a source block that is also a
destination (copies within one cache). The "ready" word is host memory
(page-locked, addressed by the device under unified addressing); on a CPU device (Triton's
interpreter) it is a slot of the record itself.
"""

from __future__ import annotations

from typing import Any

import torch

OPS = {1: "gather_blocks", 2: "scatter_blocks", 3: "copy_blocks"}
OP_CODES = {name: code for code, name in OPS.items()}
_ARG = {(1, 0): "block_ids", (2, 1): "block_ids", (3, 0): "src_ids", (3, 1): "dst_ids"}


def out_of_range(name: str, i: int, value: int, num_blocks: int) -> ValueError:
    """The error of an id outside ``[-1, num_blocks)`` (shared by the host and device checks)."""
    return ValueError(f"{name}[{i}]={value} is out of range for a cache of {num_blocks} blocks "
                      f"(valid: 0..{num_blocks - 1}, or -1 for padding)")


def repeated(name: str, block: int) -> ValueError:
    """The error of a destination block named twice in one call."""
    return ValueError(f"{name} repeats destination block {block}; destination ids must be "
                      f"distinct (only -1 padding may repeat)")


def shared(block: int) -> ValueError:
    """The error of a copy within one cache whose source and destination ids share a block."""
    return ValueError(f"src_ids and dst_ids share block {block} of one cache")


class DeviceErrors:
    """The error record of one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.record = torch.zeros(6, dtype=torch.int64, device=device)
        if device.type == "cuda":
            self.ready = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        else:
            self.ready = self.record[5:6]
        self.ready_np = self.ready.numpy()
        self.record_addr = self.record.data_ptr()
        self.ready_addr = self.ready.data_ptr()

    def take(self) -> ValueError | None:
        """Wait for ``device``, clear the record and return its error (None if clean)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        lock, code, index, value, num_blocks, _ = self.record.tolist()
        if not lock:
            self.ready_np[0] = 0
            return None
        self.record.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ready_np[0] = 0
        op, side, kind = code // 16, code % 16 // 4, code % 4
        name = _ARG.get((op, side), "block_ids")
        if kind == 2:
            base, after = shared(value), f"the destination of pair {index} is undefined"
        elif kind == 1:
            base, after = repeated(name, value), "its content is undefined"
        else:
            base = out_of_range(name, index, value, num_blocks)
            after = "that pair was skipped; nothing outside the cache was written"
        return ValueError(f"an earlier {OPS.get(op, '?')} call on {self.device} (ids checked "
                          f"by the kernel): {base}; {after}")


_RECORDS: dict[torch.device, DeviceErrors] = {}


def record_for(device: torch.device) -> DeviceErrors:
    """The error record of ``device`` (a ``torch.device`` with its index), made on first use."""
    rec = _RECORDS.get(device)
    if rec is None:
        rec = _RECORDS[device] = DeviceErrors(device)
    return rec


def raise_pending(device: torch.device) -> None:
    """Raise a finding of an earlier call on ``device`` that the host can already see (a read
    of page-locked memory, no sync); nothing when the device has no record or it is clean."""
    rec = _RECORDS.get(device)
    if rec is not None and rec.ready_np[0]:
        err = rec.take()
        if err is not None:
            raise err


def check_errors(device: Any = None) -> None:
    """Wait for the kernels queued on ``device`` (every device used so far when None) and raise
    the first bad block id they found (see the module docstring).

    Call it where a sync is affordable (the end of a step, a test). The record is cleared, so
    each finding is raised once.

    Raises
    ------
    ValueError
        ``an earlier <op> call on <device> (ids checked by the kernel): <arg>[i]=<id> is out of
        range for a cache of N blocks (...)`` (or a repeated destination block, or a block
        shared by the sources and destinations of a copy within one cache); also for a
        ``device`` that is not a device.
    """
    keys = list(_RECORDS) if device is None else [_as_device(device)]
    for key in keys:
        rec = _RECORDS.get(key)
        err = rec.take() if rec is not None else None
        if err is not None:
            raise err


def _as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` with its index (a bare ``"cuda"`` is the current GPU).

    Raises ValueError naming ``device`` when it is not a device."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a device string such as 'cuda:0', "
                         f"got {device!r}") from None
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
