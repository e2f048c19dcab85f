"""P->D KV copies between two GPUs over CUDA IPC / NVLink, and the served modes on two GPUs.

Geometry: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, block 64, bf16, NHD: 8 MiB per
block over all layers); P's cache on GPU 0, D's on GPU 1, ``--num-blocks`` (4096) each, random
distinct block ids, requests of 1K / 4K / 16K tokens. Methods, each timed across both GPUs'
streams (:func:`kvflow.bench.timing.time_calls` with two devices; cold L2: 4 rotating id sets,
ceiling buffers rotated past 2 x L2):

- ``ceiling``: one contiguous ``dst.copy_(src)`` GPU0 -> GPU1 of the same payload (same run);
- ``kvflow_pull`` / ``kvflow_push``: ``copy_blocks(..., backend="triton", direction=...)``, one
  launch for all layers (pull: kernel on D's GPU reading P; push: kernel on P's GPU writing D);
- ``per_layer_torch``: per layer and K/V: ``index_select`` on P, one peer ``copy_``,
  ``index_copy_`` on D (192 ops);
- ``per_block_memcpy``: one ``cudaMemcpyPeerAsync`` per block per layer tensor from a host loop
  (ctypes on torch's libcudart; the per-block IPC copy of FastDeploy), and ``per_block_torch``:
  the same loop with torch ``copy_`` of each block slice;
- ``xproc_pull`` / ``xproc_push``: P in a second process (``CUDA_VISIBLE_DEVICES`` = P's GPU
  only) exports its cache over CUDA IPC; this process (D) opens it by UUID.

Every method's result is checked byte for byte against P once per size. Then end to end
(:data:`SERVE_MODES`): ``python -m kvflow.serve --device cuda --model kvflow-llama-32l``
disaggregated on two GPUs (``--kv-connector ipc-push`` / ``ipc-pull``, layerwise or not) and
colocated on one; prompts of ``--serve-tokens`` with ``--max-tokens`` outputs; TTFT, TPOT,
transfer ms and its share of TTFT; token identity with colocated.

``--quick``: CPU, tiny shapes, seconds (the GPU-only parts are skipped). ``--full``: 2 GPUs,
kernels + cross-process + served (about 4 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shlex
import subprocess
import sys
import time

import torch

from . import cli
from .cases import fill_pattern, make_spec, pattern, tiny_spec

ROT = 4  # id sets rotated per method (cold L2)
PRESETS = {"quick": dict(smoke=True, tokens=[64, 256], num_blocks=64, reps=2),
           "full": dict(smoke=False, tokens=[1024, 4096, 16384], num_blocks=4096, reps=20)}
#: ``--layerwise-min-tokens`` above every prompt: the whole request moves after the prefill.
NO_LAYERWISE = ["--layerwise-min-tokens", str(1 << 30)]


def spec_of(smoke: bool):
    return tiny_spec() if smoke else make_spec(None, "NHD", "bfloat16")


def libcudart():
    """torch's loaded libcudart's ``cudaMemcpyPeerAsync`` (ctypes), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libcudart.so" in ln}
    except OSError:
        return None
    for p in sorted(paths):
        try:
            lib = ctypes.CDLL(p)
            fn = lib.cudaMemcpyPeerAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                           ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            return fn
        except (OSError, AttributeError):
            continue
    return None


def p_child(args) -> int:
    """The cross-process P: allocate, fill the pattern, export; exit on a stdin line."""
    from kvflow.cache import PagedKVCache
    from kvflow.transfer.cuda_ipc import export_cache, publish_export  # MERGE: kvflow.connector
    from kvflow.transfer.shm import unlink_segment
    cache = PagedKVCache(spec_of(False), args.num_blocks, device="cuda:0")
    fill_pattern(cache)
    torch.cuda.synchronize()
    name = publish_export(export_cache(cache), role="benchp")
    print(name, flush=True)
    try:
        sys.stdin.readline()
    finally:
        unlink_segment(name)
    return 0


class KernelBench:
    def __init__(self, a) -> None:
        from kvflow.cache import PagedKVCache
        self.a, self.spec = a, spec_of(a.smoke)
        self.pd = torch.device("cpu" if a.smoke else "cuda:0")
        self.dd = torch.device("cpu" if a.smoke else "cuda:1")
        self.cuda = self.pd.type == "cuda"
        self.P = PagedKVCache(self.spec, a.num_blocks, self.pd)
        self.D = PagedKVCache(self.spec, a.num_blocks, self.dd)
        fill_pattern(self.P)
        self.memcpy = libcudart() if self.cuda else None
        self.backend = "triton" if self.cuda or os.environ.get("TRITON_INTERPRET") == "1" else "auto"
        if self.cuda:
            from kvflow.transfer.cuda_ipc import enable_peer_access  # MERGE: kvflow.connector
            enable_peer_access(self.pd, self.dd)

    def ids(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(n)
        return [(torch.randperm(self.a.num_blocks, generator=g)[:n],
                 torch.randperm(self.a.num_blocks, generator=g)[:n]) for _ in range(ROT)]

    def time(self, fns, reps: int, warmup: int = 2) -> list[float]:
        from .timing import time_calls
        return time_calls(fns, devices=[self.pd, self.dd], warmup=warmup, reps=reps)

    def methods(self, sets, P=None, pull=None):
        """``{name: [ROT closures]}`` of every method for the id sets ``sets``."""
        from kvflow.kernels import copy_blocks
        P, D, T = P or self.P, self.D, self.spec.num_tensors
        pull = (P is self.P) if pull is None else pull
        pt, dt = P.tensors(), D.tensors()
        dv = [(s.to(self.dd), d.to(self.dd)) for s, d in sets]
        pv = [(s.to(P.device), d.to(self.dd)) for s, d in sets]
        hl = [(s.tolist(), d.tolist()) for s, d in sets]
        bb = self.spec.block_bytes

        def kv(direction):
            return lambda i: copy_blocks(P, D, *dv[i], backend=self.backend,
                                         direction=direction, validate=False)

        def per_layer(i):
            s, d = pv[i]
            for j in range(T):
                dt[j].index_copy_(0, d, pt[j].index_select(0, s).to(self.dd))

        def per_block_torch(i):
            s, d = hl[i]
            for j in range(T):
                for a, b in zip(s, d):
                    dt[j][b].copy_(pt[j][a])

        out = {}
        if pull:  # an IPC mapping is usable only from the GPU it was mapped on (cuda_ipc.py)
            out["kvflow_pull"] = kv("pull")
        if self.backend == "triton" and P.device != D.device:
            out["kvflow_push"] = kv("push")
        out["per_layer_torch"] = per_layer
        if self.memcpy is not None:
            ps, dp = [t.data_ptr() for t in pt], [t.data_ptr() for t in dt]
            fn, sd, dd = self.memcpy, P.device.index, self.dd.index

            def per_block_memcpy(i):
                s, d = hl[i]
                stream = torch.cuda.current_stream(P.device).cuda_stream
                for j in range(T):
                    for a, b in zip(s, d):
                        rc = fn(dp[j] + b * bb, dd, ps[j] + a * bb, sd, bb, stream)
                        if rc:
                            raise RuntimeError(f"cudaMemcpyPeerAsync returned {rc}")
            out["per_block_memcpy"] = per_block_memcpy
        out["per_block_torch"] = per_block_torch
        return {k: [lambda f=f, i=i: f(i) for i in range(len(sets))] for k, f in out.items()}

    def check(self, name, fn, sets, P) -> None:
        s, d = sets[0]
        for t in self.D.tensors():
            t[d.to(self.dd)] = 0
        fn[0]()
        if self.cuda:
            torch.cuda.synchronize(self.pd)
            torch.cuda.synchronize(self.dd)
        for j, t in enumerate(self.D.tensors()):
            got = t[d.to(self.dd)].reshape(len(d), -1).view(torch.int32)
            if not torch.equal(got, pattern(j, s.to(self.dd), self.spec, P.num_blocks)):
                raise AssertionError(f"{name}: D's blocks differ from P's (tensor {j})")

    def ceiling(self, nbytes: int) -> list[float]:
        """The same-run peer ceiling: ``copy_`` of ``nbytes`` P's GPU -> D's GPU, buffers
        rotated past twice a 60 MB L2 (at most 4)."""
        from .timing import copy_ceiling, rotations_for
        return copy_ceiling(nbytes, device=self.pd, dst_device=self.dd, warmup=2, reps=self.a.reps,
                            rotations=rotations_for(nbytes, 60 << 20, max_rotations=4))


def run_kernels(a, kb: KernelBench, env, rows, xproc_peer=None, variant=None) -> dict:
    """One row per (method, tokens); returns {tokens: ceiling seconds}."""
    from .schema import make_row
    from .timing import median
    variant = variant or ("cross_process" if xproc_peer is not None else "in_process")
    P = xproc_peer or kb.P
    ceilings = a._ceilings if xproc_peer is not None else {}
    for T in a.tokens:
        n = kb.spec.num_blocks_for(T)
        payload, sets = n * kb.spec.bytes_per_block, kb.ids(n)
        if T not in ceilings:
            ceilings[T] = median(kb.ceiling(payload))
        ceil, res = ceilings[T], {}
        meths = kb.methods(sets, P, pull=None if xproc_peer is None else P.device == kb.dd)
        if xproc_peer is not None:
            meths = {k.replace("kvflow", "xproc"): v for k, v in meths.items() if k.startswith("kvflow")}
        for name, fn in meths.items():
            kb.check(name, fn, sets, P)
            loop = name.startswith("per_block")
            reps = max(2, a.reps // 4) if loop else a.reps
            res[name] = kb.time(fn, reps, warmup=1 if loop else 2)
        if "per_block_memcpy" in res or "per_block_torch" in res:
            base_name = "per_block_memcpy" if "per_block_memcpy" in res else "per_block_torch"
            a._loop[T] = (median(res[base_name]), base_name)
        base, base_name = a._loop.get(T, (None, None))  # cross-process: the in-process loop
        print(f"\n{variant}: {T} tokens, {n} blocks, {payload / 2**20:.0f} MiB; ceiling "
              f"{payload / ceil / 1e9:.1f} GB/s")
        print(f"  {'method':18} {'ms':>9} {'GB/s':>8} {'x ceiling':>9} {'x loop':>8}")
        for name, ts in res.items():
            m = median(ts)
            print(f"  {name:18} {m * 1e3:9.3f} {payload / m / 1e9:8.1f} {ceil / m:9.3f} "
                  f"{(base / m) if base else float('nan'):8.1f}")
            rows.append(make_row(env, op="ipc_p2d", backend=name, spec=kb.spec, tokens=T, blocks=n,
                                 payload_bytes=payload, times_s=ts, ceiling_s=ceil, baseline_s=base,
                                 config={"variant": variant, "num_blocks": a.num_blocks,
                                         "baseline": base_name, "ceiling": "peer copy_ GPU0->GPU1"}))
    return ceilings


def run_xproc(a, kb: KernelBench, env, rows) -> None:
    from kvflow.devices import worker_env
    from kvflow.transfer.cuda_ipc import import_cache, read_export  # MERGE: kvflow.connector
    p_index = int(os.environ.get("KVFLOW_BENCH_P_GPU", "0"))
    kb.P = None  # free GPU0 for the child's cache
    torch.cuda.empty_cache()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    phys = visible.split(",")[p_index] if visible else str(p_index)
    child = subprocess.Popen([sys.executable, "-m", "kvflow.bench", "ipc", "--p-child",
                              "--num-blocks", str(a.num_blocks)],
                             env=worker_env("cuda", int(phys)) if phys.isdigit() else
                             dict(os.environ, CUDA_VISIBLE_DEVICES=phys),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        if not name:
            raise RuntimeError(f"P child exited ({child.wait()}) without exporting its cache")
        exp = read_export(name)
        peer = import_cache(exp, kb.spec, a.num_blocks)
        print(f"\ncross-process: P pid {child.pid} exported {name}; mapped here on {peer.device}")
        run_kernels(a, kb, env, rows, xproc_peer=peer)
        old = peer.buffer.data_ptr()
        del peer
        import gc
        gc.collect()
        torch.cuda.synchronize(kb.dd)
        torch.cuda.ipc_collect()
        # the same handle mapped into D's GPU context: the kernel runs on D's GPU (pull)
        peer = import_cache(exp, kb.spec, a.num_blocks, map_on=kb.dd)
        if peer.buffer.data_ptr() == old:
            print("cross-process pull skipped: torch returned the earlier mapping of the handle")
        else:
            print(f"\ncross-process: the same export mapped on {peer.device} (D's GPU)")
            run_kernels(a, kb, env, rows, xproc_peer=peer, variant="cross_process_mapped_on_d")
        del peer
    finally:
        child.stdin.close()
        child.wait(30)


async def _complete(client, url, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # model left out: the served one
    import json
    t0, ttft, toks, kv = time.perf_counter(), None, [], {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            kv = chunk.get("kvflow") or kv
            for c in chunk.get("choices") or []:
                if c.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    toks += c["token_ids"]
    e2e = time.perf_counter() - t0
    return {"ttft": ttft, "tpot": (e2e - ttft) / max(1, len(toks) - 1), "text": toks, "kvflow": kv}


#: name -> (server mode, extra ``python -m kvflow.serve`` flags)
SERVE_MODES = {
    "push-layerwise": ("disagg", ["--kv-connector", "ipc-push"]),
    "push-request": ("disagg", ["--kv-connector", "ipc-push", *NO_LAYERWISE]),
    "pull-request": ("disagg", ["--kv-connector", "ipc-pull", *NO_LAYERWISE]),
    "pull-layerwise": ("disagg", ["--kv-connector", "ipc-pull", "--layerwise-min-tokens", "0"]),
    "colocated": ("colocated", []),
    "colocated-again": ("colocated", []),  # is the reference itself repeatable?
}
for _c in (4, 8, 32):  # the grid cap of the copies beside P's compute
    SERVE_MODES[f"push-layerwise-c{_c}"] = ("disagg", [
        "--kv-connector", "ipc-push", "--kv-connector-config", f'{{"max_ctas": {_c}}}'])
for _g in (1, 2, 8):  # layers per copy launch
    SERVE_MODES[f"push-layerwise-g{_g}"] = ("disagg", [
        "--kv-connector", "ipc-push", "--kv-connector-config", f'{{"layers_per_copy": {_g}}}'])
for _m in ("push-layerwise", "push-request", "pull-request", "colocated"):
    # KVFLOW_DEBUG_KV_DIGEST: D's prompt KV digest in the kvflow object (timings are off)
    SERVE_MODES[f"{_m}-digest"] = SERVE_MODES[_m]


def run_serve(a, env, rows) -> None:
    """Serve the same prompts in every ``--serve-modes`` configuration; TTFT, TPOT, transfer
    and exposed transfer (push: P's wait for its copies after the first token + the KVPushed
    message; pull: D's whole transfer), token identity with colocated."""
    import random

    import httpx

    from .schema import make_row
    from .server import started_server
    from .timing import median
    maxlen = max(a.serve_tokens) + a.max_tokens + 64
    nb = 2 * (-(-maxlen // 64)) + 8
    common = ["--device", a.serve_device, "--model", a.model, "--dtype", a.serve_dtype,
              "--block-size", "64", "--num-blocks", str(nb), "--max-model-len", str(maxlen),
              "--max-num-batched-tokens", str(a.chunk), *shlex.split(a.server_args)]
    rng = random.Random(0)
    prompts = {T: [[rng.randint(32, 126) for _ in range(T)] for _ in range(a.serve_reps)]
               for T in a.serve_tokens}
    modes = a.serve_modes.split(",")
    if "colocated" not in modes:
        modes.append("colocated")
    if any(m.endswith("-digest") for m in modes) and "colocated-digest" not in modes:
        modes.append("colocated-digest")
    outs = {}
    for name in modes:
        if name not in SERVE_MODES:
            raise SystemExit(f"--serve-modes: unknown mode {name!r}; known: {', '.join(SERVE_MODES)}")
        mode, extra = SERVE_MODES[name]
        digest = name.endswith("-digest")
        os.environ.pop("KVFLOW_DEBUG_KV_DIGEST", None)
        if digest:
            os.environ["KVFLOW_DEBUG_KV_DIGEST"] = "1"
        try:
            with started_server(mode, common + extra, timeout=240) as url:
                async def go():
                    async with httpx.AsyncClient() as c:
                        for w in (256, a.serve_tokens[0]):  # warm-up (kernels, allocator)
                            await _complete(c, url, prompts[a.serve_tokens[0]][0][:w], 2)
                        return {T: [await _complete(c, url, p, a.max_tokens) for p in ps]
                                for T, ps in prompts.items()}
                outs[name] = asyncio.run(go())
        except Exception as exc:  # report and go on with the other modes
            print(f"serve mode {name} FAILED: {type(exc).__name__}: {exc}")
        finally:
            os.environ.pop("KVFLOW_DEBUG_KV_DIGEST", None)
    print(f"\nserved {a.model} ({a.serve_dtype}, block 64, chunk {a.chunk}): disagg P=GPU0 D=GPU1 vs colocated GPU0")
    print("  TTFT: the router's (request in -> first token out, kvflow.ttft_ms); client: as httpx saw "
          "it\n  (its streaming POST adds ~45 ms on loopback that curl does not see, so the share "
          "uses the router's)")
    print(f"  {'tokens':>6} {'mode':19} {'TTFT ms':>9} {'client':>8} {'TPOT ms':>8} {'prefill':>8} "
          f"{'xfer ms':>8} {'exposed':>8} {'exp/TTFT':>8} {'identical':>9}")
    for T in a.serve_tokens:
        for name in [m for m in modes if m in outs]:
            rs = outs[name][T]
            ref = outs.get("colocated-digest" if name.endswith("-digest") else "colocated")
            same = ref is not None and all(x["text"] == y["text"] for x, y in zip(rs, ref[T]))
            first_diff = [next((i for i, (u, v) in enumerate(zip(x["text"], y["text"])) if u != v),
                               None) for x, y in zip(rs, ref[T])] if ref is not None else []

            def med(key):
                return median([float(r["kvflow"].get(key) or 0) for r in rs])
            client, tpot = median([r["ttft"] for r in rs]), median([r["tpot"] for r in rs])
            ttft = med("ttft_ms") / 1e3
            xfer = med("transfer_ms")
            exposed = med("exposed_ms") if name.startswith("push") else xfer
            share = exposed / (ttft * 1e3)
            print(f"  {T:>6} {name:19} {ttft * 1e3:9.2f} {client * 1e3:8.2f} {tpot * 1e3:8.3f} "
                  f"{med('prefill_ms'):8.2f} "
                  f"{xfer:8.3f} {exposed:8.3f} {share:8.2%} {str(same):>9}"
                  + ("" if same else f"  first differing token per prompt: {first_diff}")
                  + (f"  kv digest equal: {[r['kvflow'].get('kv_digest') == q['kvflow'].get('kv_digest') for r, q in zip(rs, ref[T])]}"
                     if name.endswith("-digest") and ref is not None else ""))
            rows.append(make_row(env, op="serve_ipc_gpu", backend=name, spec=None, tokens=T, blocks=0,
                                 payload_bytes=int(rs[0]["kvflow"].get("payload_bytes") or 0),
                                 times_s=[float(r["kvflow"]["ttft_ms"]) / 1e3 for r in rs],
                                 ceiling_s=None, client_ttft_ms=client * 1e3,
                                 config={"model": a.model,
                                         "server_args": shlex.join(common + SERVE_MODES[name][1])},
                                 ttft_ms=ttft * 1e3, tpot_ms=tpot * 1e3, transfer_ms=xfer,
                                 exposed_ms=exposed, prefill_ms=med("prefill_ms"),
                                 copy_ms=med("copy_ms"), transfer_share=share, identical=same,
                                 client_ttfts_ms=[r["ttft"] * 1e3 for r in rs],
                                 token_ids=[r["text"] for r in rs], first_diff=first_diff,
                                 kvflow=[r["kvflow"] for r in rs]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p, device=False)
    p.add_argument("--tokens", type=cli.tokens, help="request lengths (quick 64,256; full 1K,4K,16K)")
    p.add_argument("--num-blocks", type=int, help="blocks per cache (quick 64, full 4096)")
    p.add_argument("--reps", type=int, help="timed repetitions (quick 2, full 20)")
    p.add_argument("--no-xproc", action="store_true", help="skip the cross-process variant")
    p.add_argument("--no-serve", action="store_true", help="skip the end-to-end serve runs")
    p.add_argument("--serve-only", action="store_true", help="only the end-to-end serve runs")
    p.add_argument("--serve-tokens", type=cli.tokens, default=[1024, 4096, 8192],
                   help="prompt lengths served (default 1K,4K,8K)")
    p.add_argument("--serve-device", default="cuda", help=argparse.SUPPRESS)  # cpu: a test
    p.add_argument("--serve-dtype", default="bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--serve-modes", default="push-layerwise,push-request,pull-request,colocated",
                   help=f"comma list of {', '.join(SERVE_MODES)}")
    p.add_argument("--serve-reps", type=int, default=3, help="prompts per length and mode")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    p.add_argument("--chunk", type=int, default=8192, help="--max-num-batched-tokens of the server")
    p.add_argument("--model", default="kvflow-llama-32l", help="served model")
    p.add_argument("--server-args", default="", help="extra flags for every server, e.g. "
                   "'--kv-connector-config {\"max_ctas\": 8}'")
    p.add_argument("--p-child", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    from .schema import env_info
    a = argparse.Namespace(**{**PRESETS[args.preset or "quick"],
                              **{k: v for k, v in vars(args).items() if v is not None}})
    if a.p_child:
        return p_child(a)
    if not a.smoke and a.serve_device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"ipc --full: needs 2 CUDA GPUs, found {torch.cuda.device_count()}; "
                         f"use --quick on a CPU")
    a._loop, a._ceilings = {}, {}
    env, rows = env_info("cpu" if a.smoke or a.serve_device != "cuda" else "cuda:0"), []
    t0 = time.perf_counter()
    if not a.serve_only:
        kb = KernelBench(a)
        a._ceilings = run_kernels(a, kb, env, rows)
        if a.smoke or a.no_xproc:
            print("cross-process CUDA IPC variant skipped" + (" (needs 2 GPUs)" if a.smoke else ""))
        else:
            try:
                run_xproc(a, kb, env, rows)
            except Exception as exc:  # noqa: BLE001 - report it and go on to the serve runs
                print(f"cross-process variant FAILED: {type(exc).__name__}: {exc}")
        del kb
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.smoke or a.no_serve:
        print("end-to-end serve on 2 GPUs skipped" + (" (needs 2 GPUs)" if a.smoke else ""))
    else:
        try:
            run_serve(a, env, rows)
        except Exception as exc:  # noqa: BLE001 - keep the kernel rows
            print(f"end-to-end serve FAILED: {type(exc).__name__}: {exc}")
    opts = {k: v for k, v in vars(a).items() if not k.startswith("_")}
    cli.finish(args, opts, env, rows, t0=t0)
    return 0
