"""The model side of kvflow: a Llama-family decoder with caller-supplied (paged) attention,
its configs and tokenizers, and ``load_model`` for built-in names and local HF checkpoints.

Names load on first use: ``kvflow.model.config`` (presets, :class:`ModelConfig`) imports no
torch, so the CLI checks ``--model`` and ``--max-model-len`` before torch loads."""

from __future__ import annotations

import importlib
from typing import Any

from .config import PRESETS, ModelConfig

_LAZY = {"LlamaForCausalLM": ".llama", "load_model": ".loader", "ByteTokenizer": ".tokenizer",
         "HFTokenizer": ".tokenizer"}

__all__ = ["ModelConfig", "PRESETS", "LlamaForCausalLM", "load_model", "ByteTokenizer", "HFTokenizer"]


def __getattr__(name: str) -> Any:  # the model and tokenizers load torch: import on first use
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'kvflow.model' has no attribute {name!r}")
