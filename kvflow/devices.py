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


def parent_cards(device_kind: str, device_index: int | Sequence[int],
                 base: Mapping[str, str] | None = None) -> list[str]:
    """Card ids, as the visibility variable names them, of *this* process's device ordinals:
    with ``CUDA_VISIBLE_DEVICES=2,3`` in ``base`` (default ``os.environ``), ordinal 1 is card
    ``"3"`` (entries may also be ``GPU-<uuid>`` strings); unset, ordinal ``i`` is ``"i"``.

    Raises
    ------
    ValueError
        Unknown or ``"cpu"`` ``device_kind``, a bad ``device_index``, or an ordinal past the
        visible list (naming both).
    """
    if device_kind not in VISIBILITY_VARS:
        raise ValueError(f"device_kind must be one of {tuple(VISIBILITY_VARS)}, got {device_kind!r}")
    idx = _index_list(device_index).split(",")
    env = os.environ if base is None else base
    visible = env.get(VISIBILITY_VARS[device_kind])
    if visible is None:
        return idx
    cards = [c.strip() for c in visible.split(",") if c.strip()]
    out = []
    for i in map(int, idx):
        if i >= len(cards):
            raise ValueError(f"device_index {i} is not visible: {VISIBILITY_VARS[device_kind]}="
                             f"{visible!r} shows {len(cards)} card(s)")
        out.append(cards[i])
    return out


def worker_env_for_cards(device_kind: str, cards: Sequence[str],
                         base: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`worker_env` for card ids from :func:`parent_cards` (ints or ``GPU-<uuid>``);
    repeated cards are dropped, the first keeps its place (the child's device 0 is ``cards[0]``).

    Raises
    ------
    ValueError
        Unknown ``device_kind``, or no card / an empty card id.
    """
    if device_kind not in VISIBILITY_VARS:
        raise ValueError(f"device_kind must be one of {tuple(VISIBILITY_VARS)}, got {device_kind!r}")
    uniq = list(dict.fromkeys(str(c).strip() for c in cards))
    if not uniq or not all(uniq):
        raise ValueError(f"cards must be non-empty card ids, got {list(cards)!r}")
    env = dict(os.environ if base is None else base)
    env[VISIBILITY_VARS[device_kind]] = ",".join(uniq)
    return env
