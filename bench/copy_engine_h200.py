"""copy_engine vs triton vs torch ``copy_`` as called, on one GPU; JSON rows to stdout.

Llama-3-8B geometry (32 layers, 8 KV heads, head_dim 128, bf16, NHD), 64-token blocks; a
gather of every layer at 4K and 16K tokens with random and contiguous block ids. Payload
GB/s (each byte moved once) and the ratio to ``dst.copy_(src)`` of the same byte count,
measured in the same run. Each figure is the median of back-to-back calls from Python
(``triton.testing.do_bench``: wrapper cost and the copy_engine's host read of the ids count).

    python bench/copy_engine_h200.py > copy_engine.json
"""

from __future__ import annotations

import datetime
import json
import subprocess

import torch
import triton

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import gather_blocks, payload_bytes

SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=64,
                   dtype=torch.bfloat16, layout="NHD")
NUM_BLOCKS = 1024  # 64K tokens of cache: 8 GiB, far above the 60 MB L2


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    dev = torch.device("cuda")
    cache = PagedKVCache(SPEC, NUM_BLOCKS, dev)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    from kvflow.kernels.copy_engine import launch
    rows = []
    for tokens in (4096, 16384):
        n = tokens // SPEC.block_size
        nbytes = payload_bytes(SPEC, n)
        a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        ceiling = nbytes / _ms(lambda: b.copy_(a)) / 1e6
        out = staging_buffer(SPEC, n, device=dev)
        for ids_kind in ("random", "contiguous"):
            ids = (torch.randperm(NUM_BLOCKS, device=dev)[:n] if ids_kind == "random"
                   else torch.arange(100, 100 + n, device=dev))
            for backend in ("copy_engine", "triton"):
                fn = lambda: gather_blocks(cache, ids, out, backend=backend)  # noqa: E731
                try:
                    fn()
                    gbs = nbytes / _ms(fn) / 1e6
                except Exception as exc:  # noqa: BLE001 - report, go on
                    rows.append(dict(backend=backend, tokens=tokens, ids=ids_kind,
                                     error=f"{type(exc).__name__}: {exc}"[:300]))
                    continue
                rows.append(dict(op="gather_blocks", backend=backend, layout="NHD",
                                 dtype="bfloat16", tokens=tokens, blocks=n, ids=ids_kind,
                                 payload_bytes=nbytes, gbps=round(gbs, 1),
                                 ceiling_gbps=round(ceiling, 1),
                                 ratio=round(gbs / ceiling, 3),
                                 path=launch.path() if backend == "copy_engine" else None))
    print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                          triton=triton.__version__, commit=commit,
                          date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                          rows=rows), indent=1))


if __name__ == "__main__":
    main()
