"""GPU probe for the triton and numba_cuda backends: correctness, then GB/s vs the copy ceiling.

Run on a CUDA host from the repository root::

    python tools/gpu_probe.py                 # everything (~3-5 min on one H200)
    python tools/gpu_probe.py --quick         # fewer reps and variants
    python tools/gpu_probe.py --json out.json # also write every row as JSON

1. Correctness: every op (gather, scatter, copy_blocks) x layout (NHD, HND, MLA) x dtype
   (bf16, fp16, fp32, fp8 e4m3) x layer range x id dtype, with -1 padding, at large shapes,
   byte for byte against the torch reference; pull and push between two GPUs when present.
2. Bandwidth: Llama-3-8B geometry (32 layers, 8 KV heads, head_dim 128, block 64, bf16) in a
   4096-block cache, random block ids, requests of 1K / 4K / 16K tokens. GB/s counts payload
   bytes once (DESIGN.md "Measuring"); the ceiling is ``dst.copy_(src)`` of the same byte count
   in the same run; ratio = op GB/s / ceiling GB/s. Median of ``reps`` timed calls (CUDA events)
   after warm-up, rotating two id sets / staging buffers (each >= 128 MiB, more than the 60 MB
   L2). Variants: triton default launch (one program per work item, 16 warps), persistent
   grids, 4 / 8 warps, streaming hints, 64 KiB items, ``max_ctas`` 8/32/132; numba_cuda;
   torch per-layer index_select / index_copy_ (the baseline a user would write). Then HND, MLA
   and fp8 at 4K tokens, and peer copies between two GPUs when present.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer  # noqa: E402
from kvflow.kernels import available_backends, copy_blocks, gather_blocks, scatter_blocks  # noqa: E402
from kvflow.kernels import payload_bytes  # noqa: E402
from kvflow.bench.timing import queue_ahead  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.float8_e4m3fn}


def spec_for(layout: str, dtype: torch.dtype, layers=32, heads=8, dim=128, block=64) -> KVCacheSpec:
    if layout == "MLA":  # DeepSeek-style latent: 512 + 64 rope dims
        return KVCacheSpec(num_layers=layers, num_kv_heads=1, head_dim=576, block_size=block,
                           dtype=dtype, layout="MLA")
    return KVCacheSpec(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=block,
                       dtype=dtype, layout=layout)


def fill_random_(cache: PagedKVCache, seed: int) -> PagedKVCache:
    g = torch.Generator(device=cache.device).manual_seed(seed)
    for t in cache.tensors():
        t.view(torch.uint8).random_(1, 256, generator=g)
    return cache


def rand_ids(num_blocks: int, n: int, seed: int, device, pad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=g)[:n]
    if pad:
        ids[1::7] = -1
    return ids.to(device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def cache_eq(a: PagedKVCache, b: PagedKVCache) -> bool:
    return all(same(x, y.to(x.device)) for x, y in zip(a.tensors(), b.tensors()))


def correctness(backends: list[str], dev: str) -> list[str]:
    failures, checks = [], 0
    for layout in ("NHD", "HND", "MLA"):
        for dname, dtype in DTYPES.items():
            spec = spec_for(layout, dtype, layers=8, block=16)
            src = fill_random_(PagedKVCache(spec, 512, dev), 1)
            for layers in (None, (2, 5)):
                for id_dtype in (torch.int32, torch.int64):
                    ids = rand_ids(512, 200, 2, dev, pad=True).to(id_dtype)
                    dst_ids = rand_ids(384, 200, 3, dev, pad=True).to(id_dtype)
                    ref_out = staging_buffer(spec, 200, layers, dev)
                    ref_out.view(torch.uint8).fill_(7)
                    gather_blocks(src, ids, ref_out, layers, backend="torch")
                    ref_dst = fill_random_(PagedKVCache(spec, 384, dev), 4)
                    scatter_blocks(ref_out, ref_dst, dst_ids, layers, backend="torch")
                    ref_cp = fill_random_(PagedKVCache(spec, 384, dev), 5)
                    copy_blocks(src, ref_cp, ids, dst_ids, layers, backend="torch")
                    for be in backends:
                        tag = f"{be} {layout} {dname} layers={layers} ids={id_dtype}"
                        out = staging_buffer(spec, 200, layers, dev)
                        out.view(torch.uint8).fill_(7)
                        gather_blocks(src, ids, out, layers, backend=be)
                        dst = fill_random_(PagedKVCache(spec, 384, dev), 4)
                        scatter_blocks(out, dst, dst_ids, layers, backend=be)
                        cp = fill_random_(PagedKVCache(spec, 384, dev), 5)
                        copy_blocks(src, cp, ids, dst_ids, layers, backend=be)
                        torch.cuda.synchronize()
                        for op, ok in (("gather", same(out, ref_out)),
                                       ("scatter", cache_eq(dst, ref_dst)),
                                       ("copy", cache_eq(cp, ref_cp))):
                            checks += 1
                            if not ok:
                                failures.append(f"{op} {tag}")
    if torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(1, 0):
        spec = spec_for("NHD", torch.bfloat16, layers=8, block=16)
        src = fill_random_(PagedKVCache(spec, 512, "cuda:0"), 1)
        ids, dst_ids = rand_ids(512, 200, 2, "cpu", True), rand_ids(384, 200, 3, "cpu", True)
        ref = fill_random_(PagedKVCache(spec, 384, "cuda:1"), 5)
        copy_blocks(src, ref, ids, dst_ids, backend="torch")
        for be in backends:
            for direction in ("pull", "push"):
                dst = fill_random_(PagedKVCache(spec, 384, "cuda:1"), 5)
                copy_blocks(src, dst, ids, dst_ids, backend=be, direction=direction)
                torch.cuda.synchronize(0), torch.cuda.synchronize(1)
                checks += 1
                if not cache_eq(dst, ref):
                    failures.append(f"peer copy {be} {direction}")
    print(f"correctness: {checks - len(failures)}/{checks} byte-exact checks passed")
    for f in failures:
        print("  FAIL", f)
    return failures


QUEUE_AHEAD = True  # --launch-bound turns it off: then host launch gaps count too


def time_ms(fns, reps: int, warmup: int = 3) -> list[float]:
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    if QUEUE_AHEAD:
        queue_ahead(torch.device("cuda", torch.cuda.current_device()))
    for i, (a, b) in enumerate(ev):
        a.record()
        fns[i % len(fns)]()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def stats(ms: list[float], nbytes: int) -> dict:
    q = statistics.quantiles(ms, n=10)
    med = statistics.median(ms)
    return {"ms": med, "p10_ms": q[0], "p90_ms": q[-1], "gbps": nbytes / med / 1e6}


def ceiling(nbytes: int, reps: int, dev="cuda", dst_dev=None) -> dict:
    bufs = [(torch.empty(nbytes, dtype=torch.uint8, device=dev),
             torch.empty(nbytes, dtype=torch.uint8, device=dst_dev or dev)) for _ in range(2)]
    return stats(time_ms([lambda s=s, d=d: d.copy_(s) for s, d in bufs], reps), nbytes)


def variants(backends, sms, quick):
    """(backend, label, max_ctas, LaunchConfig or None for the default)."""
    from kvflow.kernels.triton.copy_runs import LaunchConfig
    out = [("triton", "default", None, None)]
    if not quick:
        out += [("triton", "persistent", None, LaunchConfig(persistent=True)),
                ("triton", "old default", None,  # persistent, 4 warps, 16 KiB copy steps
                 LaunchConfig(persistent=True, num_warps=4, copy_block_bytes=16384)),
                ("triton", "4 warps", None, LaunchConfig(num_warps=4)),
                ("triton", "8 warps", None, LaunchConfig(num_warps=8)),
                ("triton", "stream", None, LaunchConfig(streaming=True)),
                ("triton", "chunk=64K", None, LaunchConfig(chunk_bytes=65536,
                                                           copy_chunk_bytes=65536))]
    out += [("triton", f"max_ctas={m}", m, None) for m in (8, 32, sms)]
    if "numba_cuda" in backends:
        out.append(("numba_cuda", "default", None, None))
    out.append(("torch", "per-layer", None, None))
    return out


def bench(spec, tokens_list, backends, reps, quick, rows, label, cache_blocks=4096, dev="cuda"):
    from kvflow.kernels.triton import copy_runs as cr
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = fill_random_(PagedKVCache(spec, cache_blocks, dev), 1)
    dst = PagedKVCache(spec, 1024, dev)
    for tokens in tokens_list:
        n = spec.num_blocks_for(tokens)
        nbytes = payload_bytes(spec, n)
        ids = [rand_ids(cache_blocks, n, s, dev, False) for s in (10, 11)]
        dids = [rand_ids(dst.num_blocks, n, s, dev, False) for s in (12, 13)]
        bufs = [staging_buffer(spec, n, None, dev) for _ in range(2)]
        ceil = ceiling(nbytes, reps, dev)
        rows.append(dict(op="copy_", backend="torch", variant="ceiling", case=label,
                         tokens=tokens, payload_bytes=nbytes, **ceil, ratio=1.0))
        for be, var, max_ctas, cfg in variants(backends, sms, quick):
            saved, cr.CONFIG = cr.CONFIG, cfg or cr.CONFIG
            for op in ("gather", "scatter", "copy"):
                if op == "gather":
                    fns = [lambda i=i, b=b: gather_blocks(src, i, b, backend=be, max_ctas=max_ctas,
                                                          validate=False)
                           for i, b in zip(ids, bufs)]
                elif op == "scatter":
                    fns = [lambda i=i, b=b: scatter_blocks(b, dst, i, backend=be,
                                                           max_ctas=max_ctas, validate=False)
                           for i, b in zip(dids, bufs)]
                else:
                    fns = [lambda i=i, d=d: copy_blocks(src, dst, i, d, backend=be,
                                                        max_ctas=max_ctas, validate=False)
                           for i, d in zip(ids, dids)]
                s = stats(time_ms(fns, reps), nbytes)
                rows.append(dict(op=op, backend=be, variant=var, case=label, tokens=tokens,
                                 payload_bytes=nbytes, **s, ratio=s["gbps"] / ceil["gbps"]))
            cr.CONFIG = saved
    torch.cuda.empty_cache()


def peer_bench(backends, reps, rows):
    spec = spec_for("NHD", torch.bfloat16)
    src = fill_random_(PagedKVCache(spec, 512, "cuda:0"), 1)
    dst = PagedKVCache(spec, 512, "cuda:1")
    for tokens in (4096, 16384):
        n = spec.num_blocks_for(tokens)
        nbytes = payload_bytes(spec, n)
        ids, dids = rand_ids(512, n, 1, "cuda:1", False), rand_ids(512, n, 2, "cuda:1", False)
        ceil = ceiling(nbytes, reps, "cuda:0", "cuda:1")
        rows.append(dict(op="copy_ peer", backend="torch", variant="ceiling", case="peer 0->1",
                         tokens=tokens, payload_bytes=nbytes, **ceil, ratio=1.0))
        for be in [b for b in backends if b != "torch"]:
            for direction in ("pull", "push"):
                with torch.cuda.device(0 if direction == "push" else 1):
                    fn = [lambda: copy_blocks(src, dst, ids, dids, backend=be, validate=False,
                                              direction=direction)]
                    s = stats(time_ms(fn, reps), nbytes)
                rows.append(dict(op="copy peer", backend=be, variant=direction, case="peer 0->1",
                                 tokens=tokens, payload_bytes=nbytes, **s,
                                 ratio=s["gbps"] / ceil["gbps"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--json", help="write rows and environment here")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--main-only", action="store_true",
                    help="only the Llama-3-8B NHD bf16 sweep (no HND/MLA/fp8, no peer copies)")
    ap.add_argument("--launch-bound", action="store_true",
                    help="time without filling the device queue first (host launch gaps count)")
    a = ap.parse_args(argv)
    global QUEUE_AHEAD
    QUEUE_AHEAD = not a.launch_bound
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    import triton
    avail = available_backends()
    backends = [b for b in ("triton", "numba_cuda") if avail.get(b) == "available"]
    import datetime
    import os
    env = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
           "commit": os.environ.get("KVFLOW_COMMIT", "unknown"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch": torch.__version__, "triton": triton.__version__, "backends": avail}
    print(json.dumps(env))
    failures = [] if a.skip_correctness else correctness(backends, "cuda")
    reps = a.reps or (10 if a.quick else 30)
    rows: list[dict] = []
    bench(spec_for("NHD", torch.bfloat16), (1024, 4096, 16384), backends + ["torch"], reps,
          a.quick, rows, "llama3-8b NHD bf16")
    for layout, dname in () if a.main_only else (("HND", "bf16"), ("MLA", "bf16"), ("NHD", "fp8")):
        bench(spec_for(layout, DTYPES[dname]), (4096,), backends + ["torch"], reps, True, rows,
              f"{layout} {dname}")
    if not a.main_only and torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(1, 0):
        peer_bench(backends, reps, rows)
    print(f"{'case':<20}{'op':<10}{'backend':<11}{'variant':<12}{'tokens':>7}{'MiB':>7}"
          f"{'ms':>9}{'GB/s':>8}{'ratio':>7}{'p10-p90 ms':>16}")
    for r in rows:
        print(f"{r['case']:<20}{r['op']:<10}{r['backend']:<11}{r['variant']:<12}{r['tokens']:>7}"
              f"{r['payload_bytes'] / 2**20:>7.0f}{r['ms']:>9.3f}{r['gbps']:>8.0f}"
              f"{r['ratio']:>7.2f}{r['p10_ms']:>8.3f}-{r['p90_ms']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"env": env, "failures": failures, "rows": rows},
                                           indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
