"""The KV cache spec of each role, from the flags: P's (and a colocated instance's) from
``--block-size``, ``--kv-layout``, ``--kv-dtype``; D's from the ``--decode-*`` flags where given,
else P's. When P's and D's specs differ, the connector re-blocks on the way
(:mod:`kvflow.kernels.reblock`); pairing checks that the two can be mapped
(:func:`kvflow.serve.instance.pairing.check_pairing`)."""

from __future__ import annotations

from typing import Any

from kvflow.layout import KVCacheSpec, as_torch_dtype


def role_spec(model: Any, cfg: Any, role: str) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of ``role`` ("prefill", "decode" or "colocated") for ``model``
    (its layers, KV heads, head_dim) and ``cfg`` (a :class:`~kvflow.serve.launch.config.ServeConfig`).

    >>> from types import SimpleNamespace as N
    >>> m = N(kv_spec=lambda bs, dtype, layout: (bs, dtype, layout), dtype="float32")
    >>> cfg = N(block_size=16, kv_layout="NHD", kv_dtype=None, decode_block_size=64,
    ...         decode_kv_layout=None, decode_kv_dtype="float8_e4m3fn")
    >>> role_spec(m, cfg, "decode")
    (64, torch.float8_e4m3fn, 'NHD')
    """
    bs, layout, dtype = cfg.block_size, cfg.kv_layout, cfg.kv_dtype
    if role == "decode":
        bs = cfg.decode_block_size or bs
        layout = cfg.decode_kv_layout or layout
        dtype = cfg.decode_kv_dtype or dtype
    return model.kv_spec(bs, dtype=None if dtype is None else as_torch_dtype(dtype),
                         layout=layout)
