"""Layerwise copies beside a prefill: how much of the transfer hides.

A Llama-3-8B-shaped model (:mod:`.prefill_model`, random bf16 weights) prefills T tokens into
a paged cache P (NHD, block 64); each layer's blocks go to a second cache D on the same GPU on a
side stream. Modes per T: ``alone`` (prefill only); ``event`` (after layer l an event on the
compute stream gates the side stream's copy of layer l); ``signal`` (after layer l
``signal_layer`` stores into the shared-memory segment and a layerwise worker thread enqueues
the copy: the cross-process path); ``request`` (prefill, then one copy of all layers);
``event``/``signal`` also with ``--max-ctas``. Hidden fraction: ``1 - exposed / the same copies
run alone``, clipped to [0, 1] (``hidden_frac_raw`` unclipped); also signal latency p50/p99
(host flag -> GPU gate kernel -> store -> host sees it; launch -> seen).

``--quick``: tiny shapes on the CPU in seconds; the copies there share the prefill's cores, so
the hidden fraction is noise: it checks the machinery, not the overlap. ``--full``: the H200
run (about 2 minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from contextlib import nullcontext

from . import cli
from .cases import make_spec
from .prefill_model import MODELS, Layer

PRESETS = {"quick": dict(device="cpu", model="tiny", block_size=16, tokens=[32, 80], reps=2,
                         warmup=1, latency_reps=50),
           "full": dict(device="cuda", model="llama3-8b", block_size=64,
                        tokens=[256, 1024, 4096, 8192, 16384], reps=5, warmup=2, latency_reps=200)}
_GATE = []


def gate_kernel():
    """A one-program Triton kernel that spins until the host sets ``*flag_ptr`` (bounded by
    ``max_iters`` reads); built on first use so the module imports without Triton."""
    if not _GATE:
        triton = cli.require("triton", "layerwise")
        import triton.language as tl

        @triton.jit
        def _gate(flag_ptr, max_iters):
            i = 0
            v = tl.load(flag_ptr, volatile=True)
            while (v == 0) & (i < max_iters):
                v = tl.load(flag_ptr, volatile=True)
                i += 1
        _GATE.append(_gate)
    return _GATE[0]


class Bench:
    def __init__(self, args) -> None:
        import torch
        self.args, self.dev = args, torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        g = self.g = MODELS[args.model]
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        torch.manual_seed(0)
        self.layers = [Layer(g, dtype, args.device) for _ in range(g["layers"])]
        self.spec = make_spec({"num_layers": g["layers"], "num_kv_heads": g["kv_heads"],
                               "head_dim": g["head_dim"], "block_size": args.block_size}, "NHD", dtype)
        self.backend = "triton" if self.cuda else "auto"
        self.side = torch.cuda.Stream(self.dev) if self.cuda else None
        from kvflow.signal import SignalChannel
        self.channel = SignalChannel.create(f"bench_{os.getpid()}", g["layers"], device=self.dev,
                                            store=args.store)
        self.step = 0

    def setup(self, tokens: int) -> None:
        import torch
        from kvflow.cache import PagedKVCache
        nb = self.nb = self.spec.num_blocks_for(tokens)
        self.p, self.d = PagedKVCache(self.spec, nb + 8, self.dev), PagedKVCache(self.spec, nb + 8, self.dev)
        gen = torch.Generator().manual_seed(tokens)
        self.src = torch.randperm(nb + 8, generator=gen)[:nb].to(self.dev)
        self.dst = torch.randperm(nb + 8, generator=gen)[:nb].to(self.dev)
        self.src_l, self.dst_l, self.tokens = self.src.tolist(), self.dst.tolist(), tokens
        self.x = torch.randn(tokens, self.g["hidden"], dtype=self.spec.dtype, device=self.dev)

    def copy(self, layers, max_ctas=None) -> None:
        from kvflow.kernels import copy_blocks
        copy_blocks(self.p, self.d, self.src, self.dst, layers=layers, backend=self.backend,
                    max_ctas=max_ctas, validate=False)

    def prefill(self, on_layer=None) -> torch.Tensor:
        import torch.nn.functional as F
        bs, T, nb = self.spec.block_size, self.tokens, self.nb
        x = self.x
        for i, layer in enumerate(self.layers):
            kc, vc = self.p.layer(i)

            def write_kv(k, v, kc=kc, vc=vc):
                pad = nb * bs - T
                for c, t in ((kc, k), (vc, v)):
                    t = F.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t
                    c.index_copy_(0, self.src, t.view(nb, bs, *t.shape[1:]))
            x = layer(x, write_kv)
            if on_layer is not None:
                on_layer(i)
        return x

    def _stamp(self, stream=None):
        import torch
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def _span(self, a, b) -> float:
        return (a.elapsed_time(b) / 1e3) if self.cuda else (b - a)

    def run(self, mode: str, max_ctas=None) -> tuple[float, float]:
        """One timed, checked run of ``mode``: (prefill seconds, total seconds)."""
        import torch
        L = self.g["layers"]
        if self.cuda:
            torch.cuda.synchronize()
        self.d.buffer.zero_()
        t0 = self._stamp()
        if mode == "alone":
            self.prefill()
            t1 = t2 = self._stamp()
        elif mode == "request":
            self.prefill()
            t1 = self._stamp()
            self.copy(None)
            t2 = self._stamp()
        elif mode == "event":
            def hook(i):
                ev = torch.cuda.Event()
                ev.record()
                self.side.wait_event(ev)
                with torch.cuda.stream(self.side):
                    self.copy(i, max_ctas)
            self.prefill(hook)
            t1 = self._stamp()
            t2 = self._stamp(self.side)
        else:  # signal: the shared-memory channel and a worker thread drive the copies
            self.step += 1
            step, done, ends = self.step, threading.Event(), {}

            def send(rid, layers, src, dst):
                with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
                    self.copy(layers, max_ctas)
                if layers.stop == L:
                    ends["t2"] = self._stamp(self.side)

            from kvflow.connector.layerwise import LayerwiseScheduler, LayerwiseWorker
            sched = LayerwiseScheduler(L, self.spec.block_size, send,
                                       on_done=lambda rid: done.set())
            sched.add_request("r", self.tokens, self.src_l)
            sched.set_dst_blocks("r", self.dst_l)
            sched.add_chunk("r", step, self.tokens)
            worker = LayerwiseWorker(sched, self.channel, poll_s=0.05, signal_timeout_s=60,
                                     spin_s=0.05, max_sleep_s=20e-6).start()
            try:
                self.prefill(lambda i: self.channel.signal(i, step))
                t1 = self._stamp()
                if not done.wait(120):
                    raise TimeoutError(f"layerwise signal run at {self.tokens} tokens did not finish")
            finally:
                worker.stop()
            if worker.errors:
                raise RuntimeError(f"worker errors: {worker.errors}")
            t2 = ends["t2"]
        if self.cuda:
            torch.cuda.synchronize()
        if mode != "alone":
            for tp, td in zip(self.p.tensors(), self.d.tensors()):
                if not torch.equal(td[self.dst], tp[self.src]):
                    raise AssertionError(f"{mode}: D's blocks differ from P's at {self.tokens} tokens")
        return self._span(t0, t1), self._span(t0, t2)

    def _spin_until_seen(self, t0: float) -> float:
        slots, deadline = self.channel.segment.slots, t0 + 10.0
        while slots[0, 0] < self.step:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"signal of step {self.step} not seen on the host within 10 s")
        return time.perf_counter() - t0

    def signal_latency(self, reps: int) -> dict[str, list[float]]:
        """Seconds from a host event to the host seeing the slot change."""
        import torch
        out = {"launch_to_seen": [], "flag_to_seen": []}
        for _ in range(reps):
            self.step += 1
            t0 = time.perf_counter()
            self.channel.signal(0, self.step)
            out["launch_to_seen"].append(self._spin_until_seen(t0))
        if not self.cuda:
            return out
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        f = flag.numpy()
        for _ in range(reps):
            self.step += 1
            f[0] = 0
            gate_kernel()[(1,)](flag, 1 << 22, num_warps=1)
            self.channel.signal(0, self.step)
            time.sleep(2e-3)  # the gate kernel is spinning by now
            t0 = time.perf_counter()
            f[0] = 1
            out["flag_to_seen"].append(self._spin_until_seen(t0))
            torch.cuda.synchronize()
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p, device=False)
    p.add_argument("--tokens", type=cli.tokens, help="prompt lengths (quick 32,80; full 256..16K)")
    p.add_argument("--block-size", type=int, help="tokens per block (quick 16, full 64)")
    p.add_argument("--max-ctas", type=int, default=16, help="grid cap of the background copies")
    p.add_argument("--reps", type=int, help="timed runs per mode (quick 2, full 5)")
    p.add_argument("--store", choices=("atomic", "asm"), default="atomic",
                   help="how signal_layer stores the step (kvflow.signal.triton_signal)")


def run(args) -> int:
    import torch
    from .schema import env_info, make_row
    from .timing import copy_ceiling, median, percentile, time_calls
    a = argparse.Namespace(**{**PRESETS[args.preset or "quick"],
                              **{k: v for k, v in vars(args).items() if v is not None}})
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("layerwise --full: no CUDA device; use --quick on a CPU")
    sys.setswitchinterval(2e-4)  # the worker thread and the launching thread share the GIL
    b = Bench(a)
    env, verdict = env_info(a.device), {}
    rows = cli.rows(env, {k: v for k, v in vars(a).items() if not k.startswith("_")})
    modes = [("alone", None), ("request", None), ("signal", None), ("signal", a.max_ctas)]
    if b.cuda:
        modes[2:2] = [("event", None), ("event", a.max_ctas)]
    print(f"{'tokens':>6} {'mode':>8} {'ctas':>5} {'prefill ms':>10} {'total ms':>9} {'exposed ms':>10} "
          f"{'1-layer ms':>10} {'hidden':>7} {'slowdown':>8}")
    t0 = time.perf_counter()
    for T in a.tokens:
        b.setup(T)
        payload = b.nb * b.spec.bytes_per_block
        ceil = median(copy_ceiling(payload, device=a.device, reps=max(a.reps, 5)))
        base, totals = None, {}
        for mode, ctas in modes:
            for _ in range(a.warmup):
                b.run(mode, ctas)  # compiles, allocator
            res = [b.run(mode, ctas) for _ in range(a.reps)]
            pre, tot = median([r[0] for r in res]), median([r[1] for r in res])
            one = median(time_calls([lambda: b.copy(b.g["layers"] // 2, ctas)], device=a.device, reps=20))
            alone = median(time_calls([lambda: [b.copy(i, ctas) for i in range(b.g["layers"])]],
                                      device=a.device, reps=5))
            base = pre if mode == "alone" else base
            totals[(mode, ctas)] = tot
            exposed = tot - pre if mode != "request" else tot - base
            raw = 1 - exposed / alone if mode in ("event", "signal") else 0.0
            hidden = min(1.0, max(0.0, raw))
            slow = pre / base - 1
            print(f"{T:>6} {mode:>8} {str(ctas or '-'):>5} {pre * 1e3:>10.3f} {tot * 1e3:>9.3f} "
                  f"{exposed * 1e3:>10.3f} {one * 1e3:>10.4f} {hidden:>7.1%} {slow:>8.2%}")
            rows.append(make_row(env, op=f"layerwise_{mode}", backend=b.backend, spec=b.spec, tokens=T,
                                 blocks=b.nb, payload_bytes=payload, times_s=[r[1] for r in res],
                                 ceiling_s=ceil, config={"mode": mode, "max_ctas": ctas, "model": a.model},
                                 prefill_s=pre, prefill_alone_s=base, exposed_s=exposed,
                                 one_layer_copy_s=one, copies_alone_s=alone, hidden_frac=hidden,
                                 hidden_frac_raw=raw, slowdown=slow,
                                 exposed_over_one_layer=exposed / one if one else None))
        best = min(v for (m, _), v in totals.items() if m in ("event", "signal"))
        verdict[T] = best < totals[("request", None)]
    wins = [T for T in a.tokens if verdict[T]]
    from_here = [T for T in wins if all(verdict[U] for U in a.tokens if U >= T)]
    print(f"layerwise beats request mode at: {wins or 'no length'}; suggested --layerwise-min-tokens: "
          f"{min(from_here) if from_here else 'none measured'}")
    lat = b.signal_latency(a.latency_reps)
    for kind, xs in lat.items():
        if xs:
            p50, p99 = percentile(xs, .5), percentile(xs, .99)
            print(f"signal latency {kind}: p50 {p50 * 1e6:.1f} us, p99 {p99 * 1e6:.1f} us")
            rows.append(make_row(env, op="signal_latency", backend="triton" if b.cuda else "cpu", spec=None,
                                 tokens=0, blocks=0, payload_bytes=0, times_s=xs, ceiling_s=None,
                                 config={"kind": kind}, p50_s=p50, p99_s=p99))
    b.channel.close()
    cli.finish(args, {k: v for k, v in vars(a).items() if not k.startswith("_")}, env, rows, t0=t0)
    return 0
