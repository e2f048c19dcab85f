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
colocated on one; prompts of ``--serve-tokens`` with ``--max-tokens`` outputs, each mode
started ``--serve-starts`` times: TTFT(disagg) / TTFT(colocated) and TTST with the per-hop
breakdown (:mod:`kvflow.bench.hops`), TPOT, transfer ms and its share of TTFT; token identity
with colocated.

``--quick``: CPU, tiny shapes, seconds (the GPU-only parts are skipped). ``--full``: 2 GPUs,
kernels + cross-process + served (about 4 minutes). ``--serve-only``: only the served runs,
on 2 GPUs, one (P and D share it), or ``--device cpu``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

from . import cli
from .cases import fill_pattern, make_spec, pattern, tiny_spec

from .ipc_served import SERVE_MODES, run_serve

ROT = 4  # id sets rotated per method (cold L2)
PRESETS = {"quick": dict(smoke=True, tokens=[64, 256], num_blocks=64, reps=2),
           "full": dict(smoke=False, tokens=[1024, 4096, 16384], num_blocks=4096, reps=20)}


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
    import torch
    from kvflow.cache import PagedKVCache
    from kvflow.connector.transport.cuda_ipc import export_cache, publish_export
    from kvflow.segments import unlink
    cache = PagedKVCache(spec_of(False), args.num_blocks, device="cuda:0")
    fill_pattern(cache)
    torch.cuda.synchronize()
    name = publish_export(export_cache(cache), role="benchp")
    print(name, flush=True)
    try:
        sys.stdin.readline()
    finally:
        unlink(name)
    return 0


class KernelBench:
    def __init__(self, a) -> None:
        import torch
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
            from kvflow.connector.transport.cuda_ipc import enable_peer_access
            enable_peer_access(self.pd, self.dd)

    def ids(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        import torch
        g = torch.Generator().manual_seed(n)
        return [(torch.randperm(self.a.num_blocks, generator=g)[:n],
                 torch.randperm(self.a.num_blocks, generator=g)[:n]) for _ in range(ROT)]

    def time(self, fns, reps: int, warmup: int = 2) -> list[float]:
        from .timing import time_calls
        return time_calls(fns, devices=[self.pd, self.dd], warmup=warmup, reps=reps)

    def methods(self, sets, P=None, pull=None):
        """``{name: [ROT closures]}`` of every method for the id sets ``sets``."""
        import torch
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
        import torch
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
    import torch
    from kvflow.devices import worker_env
    from kvflow.connector.transport.cuda_ipc import import_cache, read_export
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
    p.add_argument("--device", "--serve-device", dest="serve_device", default="cuda",
                   choices=("cuda", "cpu"), help="device of the served runs: cuda (P on GPU 0, "
                   "D on GPU 1; both on GPU 0 with one GPU) or cpu")
    p.add_argument("--serve-dtype", default="bfloat16", help="--dtype of the served model "
                   "(float32 for token identity with colocated)")
    p.add_argument("--serve-modes", default="push-layerwise,push-request,pull-request,colocated",
                   help=f"comma list of {', '.join(SERVE_MODES)}")
    p.add_argument("--serve-reps", type=int,
                   default=8, help="prompts per length, mode and server start")
    p.add_argument("--serve-starts", type=int, default=2,
                   help="server starts per mode (medians pool every start)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    p.add_argument("--chunk", type=int, default=8192, help="--max-num-batched-tokens of the server")
    p.add_argument("--model", default="kvflow-llama-32l", help="served model")
    p.add_argument("--server-args", default="", help="extra flags for every server, e.g. "
                   "'--kv-connector-config {\"max_ctas\": 8}'")
    p.add_argument("--p-child", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    import torch
    from .schema import env_info
    a = argparse.Namespace(**{**PRESETS[args.preset or "quick"],
                              **{k: v for k, v in vars(args).items() if v is not None}})
    if a.p_child:
        return p_child(a)
    for flag, v in (("--serve-reps", a.serve_reps), ("--serve-starts", a.serve_starts)):
        if v < 1:
            raise SystemExit(f"ipc: {flag} must be >= 1, got {v}")
    gpus = torch.cuda.device_count()
    a._gpus, a._gpu_args = (0, 1), []
    if a.serve_device == "cuda" and (not a.smoke or a.serve_only):  # GPUs this run needs
        if gpus < 1 or (gpus < 2 and not a.serve_only):
            raise SystemExit(f"ipc --full: needs 2 CUDA GPUs (--serve-only: 1), found {gpus}; "
                             f"on a CPU use --quick, or --serve-only --device cpu")
        if gpus < 2:  # P and D share GPU 0 (each gets half of --gpu-memory-utilization)
            a._gpus, a._gpu_args = (0, 0), ["--decode-device", "0"]
    a._loop, a._ceilings = {}, {}
    on_gpu = a.serve_device == "cuda" and (not a.smoke or a.serve_only)
    env = env_info("cuda:0" if on_gpu else "cpu")
    rows = cli.rows(env, {k: v for k, v in vars(a).items() if not k.startswith("_")})
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
    if a.no_serve or (a.smoke and not a.serve_only):
        print("end-to-end serve on 2 GPUs skipped" + (" (needs 2 GPUs); --serve-only --device cpu "
                                                        "serves on the CPU" if a.smoke else ""))
    else:
        cli.require("httpx", "ipc")
        try:
            run_serve(a, env, rows)
        except Exception as exc:  # noqa: BLE001 - keep the kernel rows
            print(f"end-to-end serve FAILED: {type(exc).__name__}: {exc}")
    opts = {k: v for k, v in vars(a).items() if not k.startswith("_")}
    cli.finish(args, opts, env, rows, t0=t0)
    return 0
