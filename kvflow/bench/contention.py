"""SM-contention study (GPU only): how much a background KV copy slows a prefill-like matmul.

A layerwise transfer copies layer l's blocks while the prefill computes layer l+1, so the copy
kernel competes with the prefill for SMs and memory bandwidth. ``max_ctas`` caps the copy's grid.
This study times a prefill-shaped matmul (``[prefill_tokens, 4096] @ [4096, 14336]`` in bf16,
Llama-3-8B's MLP up-projection) alone, then while ``gather_blocks`` of ``tokens`` tokens runs in a
loop on a second stream, for each ``max_ctas``; it reports the slowdown ``beside / alone - 1`` and
the copy's own GB/s at that cap (docs/design.md, "Kernel rules").
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvflow.cache import PagedKVCache, staging_buffer
from kvflow.kernels import gather_blocks, payload_bytes

from .backends import pick_backends
from .cases import make_spec
from .schema import make_row
from .timing import median, time_calls, time_on_stream

HIDDEN, INTERMEDIATE = 4096, 14336  # Llama-3-8B config.json: hidden_size, intermediate_size


def skip_reason(device: Any) -> str | None:
    """Why the study cannot run here (None when it can)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return f"the SM-contention study needs a CUDA GPU; device is {dev}"
    return None


def run_contention(opts: dict[str, Any], env: dict[str, Any], sink: list | None = None) -> list[dict]:
    """One row per (GPU backend, tokens, max_ctas); ``max_ctas`` None means an uncapped grid.
    Each row is also appended to ``sink`` (the study's row list, saved as measured) at once.

    Rows have ``op="contention"``, ``time_s`` = the matmul's median time beside the copy,
    ``baseline_ratio`` = alone / beside, and extra keys ``max_ctas``, ``prefill_tokens``,
    ``prefill_alone_ms``, ``prefill_beside_ms``, ``slowdown`` and ``copy_alone_gbps``.

    Raises
    ------
    RuntimeError
        If :func:`skip_reason` is not None (callers print it and skip instead).
    """
    reason = skip_reason(opts["device"])
    if reason:
        raise RuntimeError(reason)
    dev = torch.device(opts["device"])
    backends = [b for b in pick_backends(opts.get("backends"), dev)[0] if b != "torch"]
    if not backends:
        print("contention: no GPU copy backend besides torch is available; skipped", file=sys.stderr)
        return []
    geometry = {k: opts[k] for k in ("num_layers", "num_kv_heads", "head_dim", "block_size")}
    spec = make_spec(geometry, "NHD", "bfloat16", opts.get("mla_dim", 576))
    torch.manual_seed(opts["seed"])
    x = torch.randn(opts["prefill_tokens"], HIDDEN, device=dev, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, INTERMEDIATE, device=dev, dtype=torch.bfloat16)
    mm = lambda: x @ w  # noqa: E731
    reps = opts["reps"]
    alone = time_calls([mm], device=dev, warmup=3, reps=reps)
    t_mm = median(alone)
    side = torch.cuda.Stream(dev)
    rows = []
    for tokens in opts["tokens"]:
        n = spec.num_blocks_for(tokens)
        cache = PagedKVCache(spec, max(2 * n, 64), dev)
        ids = torch.randperm(cache.num_blocks, device=dev)[:n]
        out = staging_buffer(spec, n, device=dev)
        payload = payload_bytes(spec, n)
        for backend in backends:
            for max_ctas in opts["max_ctas"]:
                copy = lambda: gather_blocks(cache, ids, out, backend=backend,  # noqa: E731
                                             max_ctas=max_ctas, validate=False)
                t_copy = median(time_calls([copy], device=dev, warmup=2, reps=5))
                k = int(reps * t_mm / max(t_copy, 1e-6)) + 4
                torch.cuda.synchronize(dev)
                with torch.cuda.stream(side):
                    for _ in range(k):  # keep the copy busy for the whole timed window
                        copy()
                beside = time_on_stream(mm, reps)
                torch.cuda.synchronize(dev)
                t_b = median(beside)
                row = make_row(
                    env, op="contention", backend=backend, spec=spec, tokens=tokens, blocks=n,
                    payload_bytes=payload, times_s=beside, ceiling_s=None, baseline_s=t_mm,
                    seed=opts["seed"], max_ctas=max_ctas, prefill_tokens=opts["prefill_tokens"],
                    prefill_alone_ms=t_mm * 1e3, prefill_beside_ms=t_b * 1e3,
                    slowdown=t_b / t_mm - 1, copy_alone_gbps=payload / t_copy / 1e9,
                    config={"matmul": [opts["prefill_tokens"], HIDDEN, INTERMEDIATE],
                            "background_copies": k, "reps": reps, "device": str(dev)})
                rows.append(row)
                if sink is not None:
                    sink.append(row)
        del cache, out
        torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict]) -> str:
    """Text table: backend, tokens, max_ctas, prefill ms alone / beside, slowdown, copy GB/s."""
    head = f"{'backend':10} {'tokens':>7} {'ctas':>5} {'alone ms':>9} {'beside ms':>9} " \
           f"{'slowdown':>8} {'copy GB/s':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ctas = "-" if r["max_ctas"] is None else str(r["max_ctas"])
        lines.append(f"{r['backend']:10} {r['tokens']:>7} {ctas:>5} {r['prefill_alone_ms']:>9.3f} "
                     f"{r['prefill_beside_ms']:>9.3f} {r['slowdown'] * 100:>7.1f}% "
                     f"{r['copy_alone_gbps']:>9.1f}")
    return "\n".join(lines)
