"""A random 2-layer Llama for the vLLM tests, tutorial and benchmark:
``python -m kvflow.integrations.vllm.tiny_llama DIR`` (needs transformers and tokenizers).
Hidden 128, 4 query and 2 KV heads of head_dim 32, vocab 512 (``w0 .. w503`` plus 8 special
tokens), float32; seeded weights, unit-scale embeddings (greedy picks far from ties)."""

from __future__ import annotations

import argparse
import pathlib

import torch

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FF, MAXPOS = 512, 128, 2, 4, 2, 256, 1024
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<r0>", "<r1>", "<r2>", "<r3>"]


def build(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the checkpoint (config.json, model.safetensors, tokenizer files) into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from kvflow.shadow import unshadow_kernels
    unshadow_kernels()  # transformers imports the PyPI package kernels
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FF,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=MAXPOS,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(str(path))
    words = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="directory to write the checkpoint into")
    ap.add_argument("--seed", type=int, default=0)
    print(build(**vars(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
