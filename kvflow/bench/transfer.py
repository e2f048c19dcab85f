"""Transfer benchmark: kvflow's ``ipc`` and ``tcp`` connectors (:mod:`kvflow.transfer`) moving one
request's blocks from a prefill (P) cache into a decode (D) cache, per request size.

One timed request = P's ``KVSender.send`` over a ZMQ DEALER->ROUTER link on 127.0.0.1, D's
``recv_multipart``, header decode and ``KVReceiver.receive`` into D's own block ids (random,
seeded; distinct from P's), i.e. the whole P->D path the server runs, in one process.

Ceilings measured in the same run on the same payload bytes:

- ``tcp``: a plain ZMQ send of one contiguous frame of the payload over the same kind of link
  (zero-copy on both ends), the loopback ceiling;
- ``ipc``: ``dst.copy_(src)`` of the payload bytes (what pulling from P's shared memory can reach).

Every request is checked once: D's blocks equal P's blocks byte for byte.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from kvflow.cache import PagedKVCache, staging_buffer
from kvflow.kernels import gather_blocks, payload_bytes
from kvflow.layout import KVCacheSpec

from .kernels import _scramble
from .presets import LLAMA3_8B
from .schema import make_row
from .timing import copy_ceiling, median, time_calls


def _link():
    import zmq
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.ROUTER)
    port = d.bind_to_random_port("tcp://127.0.0.1")
    p = ctx.socket(zmq.DEALER)
    p.connect(f"tcp://127.0.0.1:{port}")
    for s in (p, d):
        s.setsockopt(zmq.LINGER, 0)
    return p, d


def loopback_ceiling(nbytes: int, *, warmup: int, reps: int) -> list[float]:
    """Seconds per plain ZMQ send+receive of ``nbytes`` (one frame, zero-copy) over loopback TCP."""
    p, d = _link()
    payload = torch.ones(nbytes, dtype=torch.uint8).numpy()

    def once():
        p.send(memoryview(payload), copy=False)
        _, frame = d.recv_multipart(copy=False)
        assert len(frame.buffer) == nbytes
    try:
        return time_calls([once], warmup=warmup, reps=reps)
    finally:
        p.close()
        d.close()


class _Pair:
    """P's cache, sender and link end; D's cache, receiver and link end, for one connector."""

    def __init__(self, connector: str, spec: KVCacheSpec, num_blocks: int, device: str) -> None:
        from kvflow.transfer import make_receiver
        self.name = connector
        self.shared = None
        if connector == "ipc":
            if torch.device(device).type != "cpu":
                raise RuntimeError("the ipc connector moves CPU shared-memory caches; CUDA IPC "
                                   "is issue 6's connector")
            from kvflow.transfer.ipc import IpcSender, SharedCache
            self.shared = SharedCache(spec, num_blocks, role="bench")
            self.p_cache = self.shared.cache
            self.sender = IpcSender(self.shared)
        elif connector == "tcp":
            from kvflow.transfer.tcp import TcpSender
            self.p_cache = PagedKVCache(spec, num_blocks, device)
            self.sender = TcpSender()
        else:
            raise ValueError(f"connector={connector!r}: expected 'ipc' or 'tcp'")
        self.d_cache = PagedKVCache(spec, num_blocks, device)
        self.receiver = make_receiver(connector)
        self.receiver.attach("bench-p", spec, num_blocks, **self.sender.export())
        self.p_sock, self.d_sock = _link()
        _scramble(self.p_cache.buffer)

    def request(self, src_ids: list[int], dst_ids: list[int]):
        """One request end to end; returns D's TransferStats."""
        from kvflow.protocol import decode
        keep = self.sender.send(self.p_sock, "bench", self.p_cache, src_ids, first_token=0,
                                num_prompt_tokens=len(src_ids) * self.p_cache.spec.block_size)
        _, head, *frames = self.d_sock.recv_multipart(copy=False)
        stats = self.receiver.receive(decode(head), frames, self.d_cache, dst_ids)
        del keep
        return stats

    def check(self, src_ids: list[int], dst_ids: list[int]) -> bool:
        spec, n = self.p_cache.spec, len(src_ids)
        a, b = staging_buffer(spec, n, device=self.p_cache.device), staging_buffer(spec, n, device=self.d_cache.device)
        gather_blocks(self.p_cache, src_ids, a, backend="torch")
        gather_blocks(self.d_cache, dst_ids, b, backend="torch")
        return torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu())

    def close(self) -> None:
        self.p_sock.close()
        self.d_sock.close()
        self.receiver.close()
        self.sender.close()


def run_transfer(opts: dict[str, Any], env: dict[str, Any], progress: bool = True) -> tuple[list, list]:
    """Rows (``op="transfer"``, ``backend`` = connector, and ``op="ceiling"`` rows for the
    loopback send) per request size, plus the connectors skipped with their reason.

    Transfer rows carry ``latency_ms_p50`` / ``latency_ms_p99`` (per request), ``d_copy_ms``
    (D's own copy/scatter time, median), ``ceiling`` (what the ratio is to) and ``verified``.
    """
    from tqdm import tqdm
    spec = KVCacheSpec(**LLAMA3_8B, dtype="bfloat16", layout="NHD")
    try:
        import kvflow.transfer  # noqa: F401
    except ImportError as exc:
        return [], [{"connector": c, "reason": f"kvflow.transfer is not importable ({exc})"}
                    for c in opts["connectors"]]
    g = torch.Generator().manual_seed(opts["seed"])
    rows, skipped = [], []
    sizes = [t for t in opts["tokens"] if 2 * spec.num_blocks_for(t) <= opts["num_blocks"]]
    for t in sorted(set(opts["tokens"]) - set(sizes)):
        skipped.append({"connector": "*", "reason": f"{t} tokens need more than --num-blocks "
                                                    f"{opts['num_blocks']} / 2 blocks"})
    bar = tqdm(total=len(sizes) * len(opts["connectors"]), desc="transfer",
               disable=not progress, file=sys.stderr)
    pairs = {}
    for c in opts["connectors"]:
        try:
            pairs[c] = _Pair(c, spec, opts["num_blocks"], opts["device"])
        except Exception as exc:  # noqa: BLE001 - a connector that cannot run is reported
            skipped.append({"connector": c, "reason": f"{type(exc).__name__}: {exc}"})
    try:
        for tokens in sizes:
            n = spec.num_blocks_for(tokens)
            nbytes = payload_bytes(spec, n)
            perm = torch.randperm(opts["num_blocks"], generator=g)
            src, dst = perm[:n].tolist(), perm[n:2 * n].tolist()
            ceil_s = {"tcp": median(loopback_ceiling(nbytes, warmup=opts["warmup"], reps=opts["reps"])),
                      "ipc": median(copy_ceiling(nbytes, warmup=opts["warmup"], reps=opts["reps"]))}
            for c, name in (("tcp", "zmq-loopback"), ("ipc", "copy_")):
                if c in pairs:
                    rows.append(make_row(env, op="ceiling", backend=name, spec=spec, tokens=tokens,
                                         blocks=n, payload_bytes=nbytes, times_s=[ceil_s[c]],
                                         ceiling_s=ceil_s[c], seed=opts["seed"]))
            for c, pair in pairs.items():
                ok = (pair.request(src, dst), pair.check(src, dst))[1]
                stats: list = []
                times = time_calls([lambda: stats.append(pair.request(src, dst))],
                                   warmup=opts["warmup"], reps=opts["reps"])
                d_ms = median([s.copy_ms for s in stats[-len(times):]])
                rows.append(make_row(
                    env, op="transfer", backend=c, spec=spec, tokens=tokens, blocks=n,
                    payload_bytes=nbytes, times_s=times, ceiling_s=ceil_s[c], seed=opts["seed"],
                    latency_ms_p50=_q(times, 0.5) * 1e3, latency_ms_p99=_q(times, 0.99) * 1e3,
                    d_copy_ms=d_ms, verified=ok,
                    ceiling="zmq loopback send" if c == "tcp" else "copy_ of the payload",
                    config={"num_blocks": opts["num_blocks"], "reps": opts["reps"],
                            "device": opts["device"], "preset": opts.get("preset")}))
                bar.update(1)
    finally:
        bar.close()
        for pair in pairs.values():
            pair.close()
    return rows, skipped


def _q(xs: list[float], p: float) -> float:
    """Nearest-rank percentile ``p`` (0..1) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]


def format_table(rows: list[dict]) -> str:
    """Text table: connector, tokens, MiB, GB/s, ratio to its ceiling, latency p50/p99 (ms)."""
    head = f"{'connector':13} {'tokens':>7} {'MiB':>8} {'GB/s':>8} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        p50 = r.get("latency_ms_p50", r["time_s"] * 1e3)
        p99 = r.get("latency_ms_p99", r["time_s"] * 1e3)
        lines.append(f"{r['backend']:13} {r['tokens']:>7} {r['payload_bytes'] / 2**20:>8.1f} "
                     f"{r['gbps']:>8.2f} {r['ratio'] or 0:>6.2f} {p50:>8.2f} {p99:>8.2f}"
                     + ("" if r.get("verified", True) else "  MISMATCH"))
    return "\n".join(lines)
