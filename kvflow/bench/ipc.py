"""P->D KV copies between two GPUs over CUDA IPC / NVLink, and the served modes on two GPUs.

Llama-3-8B KV (NHD, block 64, bf16), P's cache on GPU 0 and D's on GPU 1 (``--num-blocks``
each), random distinct block ids (4 rotating sets: cold L2), requests of 1K / 4K / 16K tokens,
timed across both GPUs' streams (:func:`kvflow.bench.timing.time_calls`). Methods (rows'
``backend``): the same-run ``ceiling`` (contiguous peer ``copy_``), ``kvflow_pull`` /
``kvflow_push`` (``copy_blocks``), ``per_layer_torch``, ``per_block_memcpy`` (one
``cudaMemcpyPeerAsync`` per block, via ctypes on torch's libcudart), ``per_block_torch``, and
``xproc_*`` (P's cache exported from a second process over CUDA IPC); each is checked byte for
byte against P once per size. Then the served modes (:data:`SERVE_MODES`,
:mod:`.ipc_served`). What each row does: docs/gpu_serving.md, section "Measuring: `python -m
kvflow.bench ipc`".

``--quick``: CPU, tiny shapes, seconds (GPU-only parts skipped). ``--full``: 2 GPUs, kernels +
cross-process + served. ``--serve-only``: only the served runs, on 2 GPUs, one (P and D share
it), or ``--device cpu``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

from . import cli
from .cases import fill_pattern, make_spec, pattern, tiny_spec
from .ipc_served import add_serve_arguments, check_serve_arguments, run_serve
from .ipc_xproc import p_child, run_xproc

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p, device=False)
    p.add_argument("--tokens", type=cli.tokens, help="request lengths (quick 64,256; full 1K,4K,16K)")
    p.add_argument("--num-blocks", type=int, help="blocks per cache (quick 64, full 4096)")
    p.add_argument("--reps", type=int, help="timed repetitions (quick 2, full 20)")
    p.add_argument("--no-xproc", action="store_true", help="skip the cross-process variant")
    p.add_argument("--no-serve", action="store_true", help="skip the end-to-end serve runs")
    p.add_argument("--serve-only", action="store_true", help="only the end-to-end serve runs")
    add_serve_arguments(p)
    p.add_argument("--p-child", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    import torch
    from .schema import env_info
    a = argparse.Namespace(**{**PRESETS[args.preset or "quick"],
                              **{k: v for k, v in vars(args).items() if v is not None}})
    if a.p_child:
        return p_child(a)
    check_serve_arguments(a)
    gpus = torch.cuda.device_count()
    a._gpus, a._gpu_args = (0, 1), []
    on_gpu = a.serve_device == "cuda" and (not a.smoke or a.serve_only)
    if on_gpu:  # GPUs this run needs
        if gpus < 1 or (gpus < 2 and not a.serve_only):
            raise SystemExit(f"ipc --full: needs 2 CUDA GPUs (--serve-only: 1), found {gpus}; "
                             f"on a CPU use --quick, or --serve-only --device cpu")
        if gpus < 2:  # P and D share GPU 0 (each gets half of --gpu-memory-utilization)
            a._gpus, a._gpu_args = (0, 0), ["--decode-device", "0"]
    a._loop, a._ceilings = {}, {}
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
                run_xproc(a, kb, env, rows, run_kernels)
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
