"""Device visibility of spawned workers.

A cache / transfer worker of an instance started on card N must see card N, not card 0: the
seed's PD stack forced ``XPU_VISIBLE_DEVICES`` for its cache process for exactly this reason.
Set the variable explicitly in the child's environment before it imports a device runtime:

>>> import subprocess, sys
>>> env = worker_env("cuda", 3)                    # the child sees card 3 as cuda:0
>>> subprocess.Popen([sys.executable, "-m", "my_worker"], env=env)     # doctest: +SKIP

For ``multiprocessing`` (spawn), wrap the ``start()`` in :func:`visible_devices`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping, Sequence

#: Environment variable that selects the visible cards of each accelerator kind.
VISIBILITY_VARS = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "XPU_VISIBLE_DEVICES"}
DEVICE_KINDS = ("cpu", *VISIBILITY_VARS)


def _index_list(device_index: int | Sequence[int]) -> str:
    idx = [device_index] if isinstance(device_index, int) and not isinstance(device_index, bool) \
        else device_index
    if isinstance(idx, (str, bytes)) or not isinstance(idx, Sequence) or not idx or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in idx):
        raise ValueError(f"device_index must be a non-negative int or a non-empty sequence of them, "
                         f"got {device_index!r}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"device_index repeats a card: {device_index!r}")
    return ",".join(str(i) for i in idx)


def visibility_vars(device_kind: str, device_index: int | Sequence[int] = 0) -> dict[str, str]:
    """Only the variables to set: ``{"CUDA_VISIBLE_DEVICES": "3"}``, ``{"XPU_VISIBLE_DEVICES":
    "1,2"}``; for ``"cpu"`` both set to ``""`` (the worker sees no accelerator).

    Raises
    ------
    ValueError
        Unknown ``device_kind`` or a bad ``device_index``, naming the value.
    """
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind must be one of {DEVICE_KINDS}, got {device_kind!r}")
    if device_kind == "cpu":
        return {var: "" for var in VISIBILITY_VARS.values()}
    return {VISIBILITY_VARS[device_kind]: _index_list(device_index)}


def worker_env(device_kind: str, device_index: int | Sequence[int] = 0,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a spawned worker that must use card(s) ``device_index`` of
    ``device_kind``: a copy of ``base`` (default ``os.environ``) with the visibility variable
    set explicitly (:func:`visibility_vars`). Inside the worker the card is device 0.

    Parameters
    ----------
    device_kind : {"cuda", "xpu", "cpu"}
    device_index : int or sequence of int
        Physical card index(es) as the parent numbers them.
    base : mapping, optional
        Environment to start from.

    Returns
    -------
    dict
        For ``subprocess.Popen(..., env=...)``.
    """
    env = dict(os.environ if base is None else base)
    env.update(visibility_vars(device_kind, device_index))
    return env


@contextlib.contextmanager
def visible_devices(device_kind: str, device_index: int | Sequence[int] = 0) -> Iterator[dict[str, str]]:
    """Set the visibility variable in ``os.environ`` for the duration of the block (e.g. around
    ``multiprocessing`` ``Process.start()`` with the spawn method), then restore it."""
    changes = visibility_vars(device_kind, device_index)
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield changes
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
