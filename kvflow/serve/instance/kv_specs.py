"""The KV cache spec of each role from the flags: P's (and colocated's) from ``--block-size``,
``--kv-layout``, ``--kv-dtype``; D's from the ``--decode-*`` flags where given, else P's."""

from __future__ import annotations

from typing import Any

from kvflow.layout import KVCacheSpec, as_torch_dtype


def role_spec(model: Any, cfg: Any, role: str) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of ``role`` ("prefill", "decode" or "colocated") for ``model``
    and ``cfg`` (a :class:`~kvflow.serve.launch.config.ServeConfig`)."""
    bs, layout, dtype = cfg.block_size, cfg.kv_layout, cfg.kv_dtype
    if role == "decode":
        bs = cfg.decode_block_size or bs
        layout = cfg.decode_kv_layout or layout
        dtype = cfg.decode_kv_dtype or dtype
    return model.kv_spec(bs, dtype=None if dtype is None else as_torch_dtype(dtype),
                         layout=layout)
