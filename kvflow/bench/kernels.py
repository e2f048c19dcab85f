"""The kernel sweep: gather / scatter / copy_blocks x backends x layouts x dtypes x request sizes.

For each case the sweep (1) checks the backend's result byte for byte against the torch
reference once, (2) times it over rotating id sets and staging buffers whose total exceeds
twice the last-level cache (cold L2/LLC), and (3) reports GB/s of payload, the ratio to the
same-run ceiling (``dst.copy_(src)`` of the same payload bytes, :func:`timing.copy_ceiling`) and
the speed-up over the torch backend (per-layer ``index_select`` / ``index_copy_``, the baseline a
user would write). See ../../shared/DESIGN.md "Measuring".

Block ids are random (seeded): gather reads any ``n`` blocks, scatter writes ``n`` distinct ones,
copy moves ``n`` blocks to ``n`` other blocks of the same cache (disjoint sets).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvflow.cache import PagedKVCache, staging_buffer
from kvflow.kernels import copy_blocks, gather_blocks, payload_bytes, scatter_blocks
from kvflow.kernels.registry import available_backends, get_backend
from kvflow.layout import KVCacheSpec

from .presets import reps_for
from .schema import make_row
from .timing import copy_ceiling, last_level_cache_bytes, median, rotations_for, time_calls

OPS = ("gather", "scatter", "copy")


def pick_backends(requested: list[str] | None, device: torch.device) -> tuple[list[str], dict[str, str]]:
    """Backends to sweep on ``device`` (torch first, as the baseline) and why others are left out.

    ``requested=None`` means every backend available here that runs on ``device`` (except Triton
    on a CPU, which is its interpreter); an explicitly requested backend that cannot run raises
    (never silently dropped).

    Raises
    ------
    ValueError, RuntimeError
        From :func:`kvflow.kernels.registry.get_backend`, naming the backend.
    """
    left_out: dict[str, str] = {}
    names = []
    if requested is None:
        for name, state in available_backends().items():
            if state != "available":
                left_out[name] = state
                continue
            try:
                get_backend(name, device)
            except (ValueError, RuntimeError) as exc:
                left_out[name] = str(exc)
                continue
            if name == "triton" and device.type == "cpu":
                left_out[name] = ("runs in Triton's interpreter here (TRITON_INTERPRET=1): a "
                                  "correctness mode, not a speed; name it in --backends to time it")
                continue
            names.append(name)
    else:
        for name in requested:
            get_backend(name, device)
            names.append(name)
    names.sort(key=lambda n: (n != "torch", n))
    return names, left_out


def make_spec(geometry: dict[str, int], layout: str, dtype: str, mla_dim: int) -> KVCacheSpec:
    """The cache spec of a case; MLA keeps the layer count and block size and stores one latent
    of ``mla_dim`` per token (576 = DeepSeek-V3's kv_lora_rank 512 + rope dim 64)."""
    if layout == "MLA":
        return KVCacheSpec(num_layers=geometry["num_layers"], num_kv_heads=1, head_dim=mla_dim,
                           block_size=geometry["block_size"], dtype=dtype, layout="MLA")
    return KVCacheSpec(**geometry, dtype=dtype, layout=layout)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _scramble(t: torch.Tensor) -> None:
    """Fill ``t`` with random bytes (8 at a time when possible: 7x faster than uint8 on CPU)."""
    b = _u8(t)
    if b.numel() % 8 == 0:
        b.view(torch.int64).random_()
    else:
        b.random_(0, 256)


class _Case:
    """Buffers of one (spec, tokens) case: ``rot`` id sets and staging buffers."""

    def __init__(self, cache: PagedKVCache, n: int, rot: int, gen: torch.Generator) -> None:
        self.cache, self.n, self.rot = cache, n, rot
        dev = cache.device
        perms = [torch.randperm(cache.num_blocks, generator=gen) for _ in range(rot)]
        self.ids = [p[:n].to(dev) for p in perms]
        self.dst_ids = [p[n:2 * n].to(dev) for p in perms]
        self.bufs = []
        for _ in range(rot):
            b = staging_buffer(cache.spec, n, device=dev)
            _scramble(b)
            self.bufs.append(b)

    def fns(self, op: str, backend: str, max_ctas: int | None) -> list:
        c, kw = self.cache, {"backend": backend, "max_ctas": max_ctas, "validate": False}
        if op == "gather":
            return [lambda i=i: gather_blocks(c, self.ids[i], self.bufs[i], **kw) for i in range(self.rot)]
        if op == "scatter":
            return [lambda i=i: scatter_blocks(self.bufs[i], c, self.ids[i], **kw) for i in range(self.rot)]
        return [lambda i=i: copy_blocks(c, c, self.ids[i], self.dst_ids[i], **kw) for i in range(self.rot)]

    def verify(self, op: str, backend: str, max_ctas: int | None) -> bool:
        """Run the op once with ``backend`` and compare the bytes with the torch reference.

        The destination is overwritten with fresh random bytes first, so a backend that writes
        nothing cannot pass on what an earlier backend left there."""
        c, ids, buf = self.cache, self.ids[0], self.bufs[0]
        ref = staging_buffer(c.spec, self.n, device=c.device)
        _scramble(buf)
        if op == "gather":
            gather_blocks(c, ids, buf, backend=backend, max_ctas=max_ctas)
            gather_blocks(c, ids, ref, backend="torch")
            return torch.equal(_u8(buf), _u8(ref))
        if op == "scatter":
            scatter_blocks(buf, c, ids, backend=backend, max_ctas=max_ctas)
            gather_blocks(c, ids, ref, backend="torch")
            return torch.equal(_u8(buf), _u8(ref))
        dst = self.dst_ids[0]
        scatter_blocks(buf, c, dst, backend="torch")  # dst blocks now differ from src blocks
        copy_blocks(c, c, ids, dst, backend=backend, max_ctas=max_ctas)
        gather_blocks(c, ids, ref, backend="torch")
        gather_blocks(c, dst, buf, backend="torch")
        return torch.equal(_u8(buf), _u8(ref))


def run_kernels(opts: dict[str, Any], env: dict[str, Any], progress: bool = True) -> tuple[list, list]:
    """Run the sweep described by ``opts`` (the parsed flags of ``kernels``).

    Returns
    -------
    rows : list of dict
        One :func:`kvflow.bench.schema.make_row` row per (op, backend, layout, dtype, tokens,
        max_ctas), with extra keys ``max_ctas``, ``verified``, ``rotations``, ``cold``.
    skipped : list of dict
        Cases that did not run, with the reason (e.g. a request larger than the cache).
    """
    from tqdm import tqdm

    device = torch.device(opts["device"])
    backends, left_out = pick_backends(opts.get("backends"), device)
    llc = last_level_cache_bytes(device)
    gen = torch.Generator().manual_seed(opts["seed"])
    torch.manual_seed(opts["seed"])
    skipped = [{"backend": b, "reason": r} for b, r in left_out.items()]
    geometry = {k: opts[k] for k in ("num_layers", "num_kv_heads", "head_dim", "block_size")}
    combos = [(lay, dt) for lay in opts["layouts"] for dt in opts["dtypes"]]
    total = len(combos) * len(opts["tokens"]) * len(opts["ops"])
    rows: list[dict] = []
    bar = tqdm(total=total, desc="kernels", disable=not progress, file=sys.stderr)
    for layout, dtype in combos:
        spec = make_spec(geometry, layout, dtype, opts["mla_dim"])
        cache = PagedKVCache(spec, opts["num_blocks"], device)
        _scramble(cache.buffer)
        for tokens in opts["tokens"]:
            n = spec.num_blocks_for(tokens)
            need = 2 * n if "copy" in opts["ops"] else n
            if need > opts["num_blocks"]:
                skipped.append({"layout": layout, "dtype": dtype, "tokens": tokens,
                                "reason": f"needs {need} blocks; --num-blocks is {opts['num_blocks']}"})
                bar.update(len(opts["ops"]))
                continue
            payload = payload_bytes(spec, n)
            rot = rotations_for(payload, llc, max_rotations=opts.get("max_rotations", 8))
            reps = reps_for(payload, opts["reps"])
            case = _Case(cache, n, rot, gen)
            ceiling_s = median(copy_ceiling(payload, device=device, rotations=rot,
                                            warmup=opts["warmup"], reps=reps))
            for op in opts["ops"]:
                baseline_s = None
                for backend in backends:
                    ctas_list = [None] if backend == "torch" or device.type == "cpu" else opts["max_ctas"]
                    for max_ctas in ctas_list:
                        if opts.get("threads"):  # numba's OpenMP resets torch's count
                            torch.set_num_threads(opts["threads"])
                        try:
                            ok = case.verify(op, backend, max_ctas)
                            times = time_calls(case.fns(op, backend, max_ctas), device=device,
                                               warmup=opts["warmup"], reps=reps)
                        except Exception as exc:  # noqa: BLE001 - one backend's failure is reported, not fatal
                            skipped.append({"op": op, "backend": backend, "layout": layout,
                                            "dtype": dtype, "tokens": tokens, "max_ctas": max_ctas,
                                            "reason": f"{type(exc).__name__}: {exc}"})
                            continue
                        if not ok:
                            print(f"kernels: {backend} {op} {layout} {dtype} {tokens} tokens differs "
                                  f"from the torch reference", file=sys.stderr)
                        if backend == "torch":
                            baseline_s = median(times)
                        rows.append(make_row(
                            env, op=op, backend=backend, spec=spec, tokens=tokens, blocks=n,
                            payload_bytes=payload, times_s=times, ceiling_s=ceiling_s,
                            baseline_s=baseline_s, seed=opts["seed"], max_ctas=max_ctas,
                            verified=ok, rotations=rot, cold=rot * payload > llc,
                            config={"num_blocks": opts["num_blocks"], "reps": reps,
                                    "warmup": opts["warmup"], "device": str(device),
                                    "llc_bytes": llc, "preset": opts.get("preset")}))
                bar.update(1)
            del case
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return rows, skipped


def format_table(rows: list[dict]) -> str:
    """Compact text table: op, backend, layout, dtype, tokens, max_ctas, GB/s, ratio, x torch."""
    head = f"{'op':8} {'backend':10} {'layout':6} {'dtype':14} {'tokens':>7} {'ctas':>5} " \
           f"{'GB/s':>9} {'ratio':>6} {'xtorch':>7}"
    lines = [head, "-" * len(head)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        lines.append(f"{r['op']:8} {r['backend']:10} {r['layout']:6} {r['dtype']:14} "
                     f"{r['tokens']:>7} {fmt(r.get('max_ctas'), 'd'):>5} {fmt(r['gbps'], '.2f'):>9} "
                     f"{fmt(r['ratio'], '.2f'):>6} {fmt(r['baseline_ratio'], '.2f'):>7}"
                     + ("" if r.get("verified", True) else "  MISMATCH"))
    return "\n".join(lines)
