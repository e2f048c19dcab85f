"""The model side of kvflow: a Llama-family decoder with caller-supplied (paged) attention,
its configs and tokenizers, and ``load_model`` for built-in names and local HF checkpoints."""

from .config import PRESETS, ModelConfig
from .llama import LlamaForCausalLM
from .loader import load_model
from .tokenizer import ByteTokenizer, HFTokenizer

__all__ = ["ModelConfig", "PRESETS", "LlamaForCausalLM", "load_model", "ByteTokenizer", "HFTokenizer"]
