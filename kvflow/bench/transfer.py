"""P->D transfer through a connector (``ipc-pull``, ``ipc-push``, ``tcp``): one request's
blocks from a prefill (P) cache into a decode (D) cache, per request size.

One timed request = P's half sending over a ZMQ DEALER->ROUTER link on 127.0.0.1, D's
``recv_multipart``, header decode and D's half receiving into D's own block ids (random,
seeded; distinct from P's), i.e. the whole P->D path the server runs, in one process.

Ceilings measured in the same run on the same payload bytes (:data:`CEILINGS`):

- ``tcp``: a plain ZMQ send of one contiguous frame of the payload over the same kind of link
  (zero-copy on both ends), the loopback ceiling;
- ``ipc-pull`` / ``ipc-push``: ``dst.copy_(src)`` of the payload bytes (what a copy between
  the two caches' memory can reach).

Every request is checked once: D's blocks equal P's blocks byte for byte.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import cli
from .cases import LLAMA3_8B, blocks_equal, make_spec, scramble
from .timing import copy_ceiling, median, percentile, time_calls

CONNECTORS = ("ipc-pull", "ipc-push", "tcp")
#: connector -> the same-run ceiling its ratio is taken against (row ``backend``, description)
CEILINGS = {"ipc-pull": ("copy_", "copy_ of the payload"),
            "ipc-push": ("copy_", "copy_ of the payload"),
            "tcp": ("zmq-loopback", "zmq loopback send")}


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
    import torch
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


def make_halves(connector: str, spec, num_blocks: int, device: str):
    """P's cache and half, D's cache and half of ``connector`` (``D.attach`` done).

    Returns ``(p_cache, sender, d_cache, receiver)``; closing the halves frees the rest.

    Raises
    ------
    RuntimeError
        A connector that cannot run here, naming why.
    """
    # MERGE: use kvflow.connector factory (make_sender / make_receiver by name, ipc-push too)
    import torch

    from kvflow.cache import PagedKVCache
    from kvflow.transfer import make_receiver
    if connector == "ipc-pull":
        if torch.device(device).type != "cpu":
            raise RuntimeError("this build's ipc-pull bench moves CPU shared-memory caches; the "
                               "CUDA IPC path comes with the connector factory")
        from kvflow.transfer.ipc import IpcSender, SharedCache
        shared = SharedCache(spec, num_blocks, role="bench")
        p_cache, sender = shared.cache, IpcSender(shared)
        receiver = make_receiver("ipc")
    elif connector == "tcp":
        from kvflow.transfer.tcp import TcpSender
        p_cache, sender = PagedKVCache(spec, num_blocks, device), TcpSender()
        receiver = make_receiver("tcp")
    elif connector == "ipc-push":
        raise RuntimeError("ipc-push is benched through the connector factory (kvflow.connector)")
    else:
        raise ValueError(f"connector={connector!r}: expected one of {', '.join(CONNECTORS)}")
    d_cache = PagedKVCache(spec, num_blocks, device)
    receiver.attach("bench-p", spec, num_blocks, **sender.export())
    return p_cache, sender, d_cache, receiver


class _Pair:
    """P's cache, half and link end; D's cache, half and link end, for one connector."""

    def __init__(self, connector: str, spec, num_blocks: int, device: str) -> None:
        self.name = connector
        self.p_cache, self.sender, self.d_cache, self.receiver = make_halves(
            connector, spec, num_blocks, device)
        self.p_sock, self.d_sock = _link()
        scramble(self.p_cache.buffer)

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
        return blocks_equal(self.p_cache, src_ids, self.d_cache, dst_ids)

    def close(self) -> None:
        self.p_sock.close()
        self.d_sock.close()
        self.receiver.close()
        self.sender.close()


def run_transfer(opts: dict[str, Any], env: dict[str, Any], progress: bool = True) -> tuple[list, list]:
    """Rows (``op="transfer"``, ``backend`` = connector, and ``op="ceiling"`` rows) per request
    size, plus the connectors skipped with their reason.

    Transfer rows carry ``latency_ms_p50`` / ``latency_ms_p99`` (per request), ``d_copy_ms``
    (D's own copy/scatter time, median), ``ceiling`` (what the ratio is to) and ``verified``.
    """
    import torch

    from kvflow.kernels import payload_bytes

    from .schema import make_row
    spec = make_spec(LLAMA3_8B, "NHD", "bfloat16")
    g = torch.Generator().manual_seed(opts["seed"])
    rows, skipped = [], []
    sizes = [t for t in opts["tokens"] if 2 * spec.num_blocks_for(t) <= opts["num_blocks"]]
    for t in sorted(set(opts["tokens"]) - set(sizes)):
        skipped.append({"connector": "*", "reason": f"{t} tokens need more than --num-blocks "
                                                    f"{opts['num_blocks']} / 2 blocks"})
    pairs = {}
    for c in opts["connectors"]:
        try:
            pairs[c] = _Pair(c, spec, opts["num_blocks"], opts["device"])
        except Exception as exc:  # noqa: BLE001 - a connector that cannot run is reported
            skipped.append({"connector": c, "reason": f"{type(exc).__name__}: {exc}"})
    bar = cli.progress(len(sizes) * len(pairs), "transfer", progress)
    try:
        for tokens in sizes:
            n = spec.num_blocks_for(tokens)
            nbytes = payload_bytes(spec, n)
            perm = torch.randperm(opts["num_blocks"], generator=g)
            src, dst = perm[:n].tolist(), perm[n:2 * n].tolist()
            ceil_s = {}
            for name in dict.fromkeys(CEILINGS[c][0] for c in pairs):
                ts = (loopback_ceiling(nbytes, warmup=opts["warmup"], reps=opts["reps"])
                      if name == "zmq-loopback" else
                      copy_ceiling(nbytes, device=opts["device"], warmup=opts["warmup"], reps=opts["reps"]))
                ceil_s[name] = median(ts)
                rows.append(make_row(env, op="ceiling", backend=name, spec=spec, tokens=tokens,
                                     blocks=n, payload_bytes=nbytes, times_s=ts,
                                     ceiling_s=ceil_s[name], seed=opts["seed"]))
            for c, pair in pairs.items():
                ok = (pair.request(src, dst), pair.check(src, dst))[1]
                stats: list = []
                times = time_calls([lambda: stats.append(pair.request(src, dst))],
                                   warmup=opts["warmup"], reps=opts["reps"])
                d_ms = median([s.copy_ms for s in stats[-len(times):]])
                ceiling, what = CEILINGS[c]
                rows.append(make_row(
                    env, op="transfer", backend=c, spec=spec, tokens=tokens, blocks=n,
                    payload_bytes=nbytes, times_s=times, ceiling_s=ceil_s[ceiling], seed=opts["seed"],
                    latency_ms_p50=percentile(times, 0.5) * 1e3,
                    latency_ms_p99=percentile(times, 0.99) * 1e3,
                    d_copy_ms=d_ms, verified=ok, ceiling=what,
                    config={"num_blocks": opts["num_blocks"], "reps": opts["reps"],
                            "device": opts["device"], "preset": opts.get("preset")}))
                bar.update(1)
    finally:
        bar.close()
        for pair in pairs.values():
            pair.close()
    return rows, skipped


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p)
    p.add_argument("--connectors", type=cli.csv(),
                   help=f"comma list of {','.join(CONNECTORS)} (default ipc-pull,tcp)")
    p.add_argument("--tokens", type=cli.tokens, help="request sizes in tokens")
    p.add_argument("--num-blocks", type=int, help="blocks per cache (quick 16, full 2048)")
    p.add_argument("--warmup", type=int, help="untimed requests per size")
    p.add_argument("--reps", type=int, help="timed requests per size")


def run(args) -> int:
    from .schema import env_info
    cli.require("zmq", "transfer")
    opts = cli.resolve(args, "transfer")
    unknown = [c for c in opts["connectors"] if c not in CONNECTORS]
    if unknown:
        raise SystemExit(f"--connectors: unknown {', '.join(unknown)}; known: {', '.join(CONNECTORS)}")
    env = env_info(opts["device"])
    t0 = time.perf_counter()
    rows, skipped = run_transfer(opts, env, progress=not args.no_progress)
    print(format_table(rows))
    for s in skipped:
        print(f"transfer: skipped {s['connector']}: {s['reason']}", file=sys.stderr)
    cli.finish(args, opts, env, rows, {"skipped": skipped}, t0=t0)
    return 0
