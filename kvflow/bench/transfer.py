"""P->D transfer through a connector (``ipc-pull``, ``ipc-push``, ``tcp``, ``nixl`` and
``nixl-staged``, :mod:`.nixl`): one request's blocks from a prefill (P) cache into a decode (D)
cache, per request size.

Both halves come from the connector factory (:func:`kvflow.connector.make_sender` /
:func:`~kvflow.connector.make_receiver`), are paired as the server pairs them and talk over a
ZMQ DEALER->ROUTER link on 127.0.0.1. P's cache holds random bytes (KV already computed, no
model runs); one timed request is :meth:`KVSender.send_prefilled
<kvflow.connector.base.KVSender.send_prefilled>`, D's ``recv_multipart``, header decode and
:meth:`KVReceiver.receive` into D's own block ids (random, seeded; distinct from P's).
``--peer-process`` (the default on CUDA) runs D in its own process (:mod:`.remote_pair`) on
``--d-device`` (default: the second GPU when there are two, else P's), as CUDA IPC and NIXL's
``cuda_ipc`` need; a request then also counts D's reply to P.

Ceilings (:data:`CEILINGS`), measured in the same run on the same payload bytes: ``tcp``, a
plain zero-copy ZMQ send of one frame over the same kind of link; ``ipc-pull`` / ``ipc-push``,
``dst.copy_(src)`` from P's device to D's; ``nixl`` / ``nixl-staged``, the fastest bulk NIXL
WRITE over several descriptor sizes (:func:`.nixl.write_ceiling`; the row's ``chunk_bytes``).
Every size is checked once per connector: D's blocks (zeroed first) equal P's byte for byte.
One connector's pair of caches (``--num-blocks`` blocks each; 8 MiB per Llama-3-8B block) lives
at a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvflow.connector import CONNECTORS

from . import cli
from .nixl import KINDS as NIXL_KINDS
from .nixl import connector_of, descs_ceiling, write_ceiling
from .loopback import link as _link, loopback_ceiling
from .remote_pair import RemotePair, bench_job, remote_write_ceiling
from .cases import LLAMA3_8B, blocks_equal, disjoint_ids, make_spec, scramble
from .timing import copy_ceiling, median, percentile, time_calls

#: connector -> the same-run ceiling its ratio is taken against (row ``backend``, description)
CEILINGS = {"ipc-pull": ("copy_", "copy_ of the payload"),
            "ipc-push": ("copy_", "copy_ of the payload"),
            "tcp": ("zmq-loopback", "zmq loopback send"),
            "nixl": ("nixl-write", "bulk NIXL WRITE of the payload"),
            "nixl-staged": ("nixl-write", "bulk NIXL WRITE of the payload"),
            "nixl-staged-uncapped": ("nixl-write", "bulk NIXL WRITE of the payload")}
#: what --connectors accepts
KINDS = (*CONNECTORS, *[k for k in NIXL_KINDS if k not in CONNECTORS])


class _Pair:
    """P's half (with its cache and link end) and D's half (with its cache and link end) of one
    connector, built by the factory and paired as the server pairs them."""

    def __init__(self, connector: str, spec, num_blocks: int, device: str,
                 longest: int | None = None) -> None:
        from kvflow.connector import Peer, make_receiver, make_sender
        self.name = connector
        kind, config = connector_of(connector)
        # the largest request in tokens (default: the whole cache) sizes nixl-staged's staging
        longest = longest or num_blocks * spec.block_size
        self.sender = make_sender(kind, spec, device, config=config, instance_id="bench-p",
                                  max_model_len=longest)
        self.receiver = make_receiver(kind, spec, device, config=config, max_model_len=longest)
        self.p_sock, self.d_sock = _link()
        try:
            self.p_cache = self.sender.make_cache(num_blocks)
            self.d_cache = self.receiver.make_cache(num_blocks)
            self.receiver.attach(Peer("bench-p", spec, num_blocks, **self.sender.export()))
            self.sender.attach(Peer("bench-d", spec, num_blocks, **self.receiver.export()),
                               link=self.p_sock)
        except BaseException:
            self.close()
            raise
        scramble(self.p_cache.buffer)

    def request(self, src_ids: list[int], dst_ids: list[int]):
        """One request end to end; returns D's TransferStats."""
        from kvflow.connector.messages import decode
        job = bench_job(self.p_cache.spec, src_ids, dst_ids)
        self.receiver.expect(job.req_id)  # as D does at allocation (nixl: progress fast)
        handoff = self.sender.send_prefilled(job, 0)
        _, head, *frames = self.d_sock.recv_multipart(copy=False)
        stats = self.receiver.receive(decode(head), frames, self.d_cache, dst_ids, "bench-p")
        del handoff  # D is done: P may drop its staging buffer
        return stats

    def hold(self, on: bool) -> None:
        """D's receiver progresses fast (``on``) or not, as while a request's KV may come."""
        (self.receiver.expect if on else self.receiver.forget)("bench-hold")

    def check(self, src_ids: list[int], dst_ids: list[int]) -> bool:
        """One request into zeroed D blocks; D's blocks equal P's byte for byte."""
        self.d_cache.buffer.zero_()
        self.request(src_ids, dst_ids)
        return blocks_equal(self.p_cache, src_ids, self.d_cache, dst_ids)

    def close(self) -> None:
        self.sender.close()  # closes p_sock, its link
        self.p_sock.close()
        self.d_sock.close()
        self.receiver.close()


def run_transfer(opts: dict[str, Any], env: dict[str, Any],
                 progress: bool = True) -> tuple[list, list]:
    """Rows (``op="transfer"``, ``backend`` = connector, and ``op="ceiling"`` rows) per request
    size, plus the connectors skipped with their reason.

    Transfer rows carry ``latency_ms_p50`` / ``latency_ms_p99`` (per request), ``d_copy_ms``
    (the connector's copy time, median, :attr:`TransferStats.copy_ms
    <kvflow.connector.base.TransferStats.copy_ms>`: D's copy / scatter for ipc-pull and tcp,
    P's copy into D's cache for ipc-push), ``ceiling`` (what the ratio is to) and ``verified``.
    """
    import torch
    _peer_opts(opts)
    geometry = {**LLAMA3_8B, "block_size": opts.get("block_size") or LLAMA3_8B["block_size"]}
    spec = make_spec(geometry, opts.get("layout") or "NHD", "bfloat16")
    g = torch.Generator().manual_seed(opts["seed"])
    rows, skipped = cli.rows(env, opts), []
    sizes = [t for t in opts["tokens"] if 2 * spec.num_blocks_for(t) <= opts["num_blocks"]]
    for t in sorted(set(opts["tokens"]) - set(sizes)):
        n = opts["num_blocks"]
        skipped.append({"connector": "*", "reason": f"{t} tokens need 2 x {spec.num_blocks_for(t)} "
                        f"block ids (P's and D's disjoint), more than --num-blocks {n}"})
    ids = {t: _ids(opts.get("ids") or "random", opts["num_blocks"], spec.num_blocks_for(t), g)
           for t in sizes}  # the same blocks for every connector
    ceil_s: dict[tuple[str, int], float] = {}
    bar = cli.progress(len(sizes) * len(opts["connectors"]), "transfer", progress)
    try:
        # One connector's pair of caches at a time: with Llama-3-8B's 8 MiB blocks, every pair
        # held at once (each cache --num-blocks x 8 MiB) outgrows a host's memory.
        for c in opts["connectors"]:
            name = CEILINGS[c][0]
            for tokens in sizes:  # before the pair: its agents' progress threads share the cores
                if (name, tokens) not in ceil_s:  # first use: measure it (same run)
                    rows.append(_ceiling(name, spec, tokens, opts, env))
                    ceil_s[name, tokens] = rows[-1]["time_s"]
            try:
                pair = (RemotePair(c, spec, geometry, opts["num_blocks"], opts["device"],
                                   opts["d_device"], max(sizes, default=1))
                        if opts["peer_process"] else
                        _Pair(c, spec, opts["num_blocks"], opts["device"], max(sizes, default=1)))
            except Exception as exc:  # noqa: BLE001 - a connector that cannot run is reported
                skipped.append({"connector": c, "reason": f"{type(exc).__name__}: {exc}"})
                bar.update(len(sizes))
                continue
            try:
                for tokens in sizes:
                    rows.append(_measure(pair, c, spec, tokens, *ids[tokens], opts, env,
                                         ceil_s[name, tokens]))
                    bar.update(1)
            finally:
                pair.close()
    finally:
        bar.close()
    return rows, skipped


def _ids(kind: str, num_blocks: int, n: int, g) -> tuple[list[int], list[int]]:
    """P's and D's ids of an ``n``-block request: ``random`` (disjoint, seeded: every block its
    own run) or ``contiguous`` (P's ``0..n-1`` into D's ``n..2n-1``: one run)."""
    if kind == "contiguous":
        return list(range(n)), list(range(n, 2 * n))
    src, dst = disjoint_ids(num_blocks, n, g)
    return src.tolist(), dst.tolist()


def _ceiling(name: str, spec, tokens: int, opts: dict[str, Any], env: dict[str, Any]) -> dict:
    """The ceiling row ``name`` (:data:`CEILINGS`) of the payload of ``tokens``."""
    from kvflow.kernels import payload_bytes

    from .schema import make_row
    n = spec.num_blocks_for(tokens)
    nbytes = payload_bytes(spec, n)
    w, r = opts["warmup"], opts["reps"]
    extra = {}
    if name == "zmq-loopback":
        ts = loopback_ceiling(nbytes, warmup=w, reps=r)
    elif name == "nixl-write":
        ts, chunk = (remote_write_ceiling(nbytes, device=opts["device"], d_device=opts["d_device"],
                                          warmup=w, reps=r) if opts["peer_process"] else
                     write_ceiling(nbytes, warmup=w, reps=r, device=opts["device"]))
        extra["chunk_bytes"] = chunk or nbytes
    else:
        ts = copy_ceiling(nbytes, device=opts["device"], dst_device=opts["d_device"],
                          warmup=w, reps=r)
    return make_row(env, op="ceiling", backend=name, spec=spec, tokens=tokens, blocks=n,
                    payload_bytes=nbytes, times_s=ts, ceiling_s=median(ts), seed=opts["seed"],
                    **extra)


def _measure(pair: _Pair, c: str, spec, tokens: int, src: list[int], dst: list[int],
             opts: dict[str, Any], env: dict[str, Any], ceiling_s: float) -> dict:
    """The transfer row of connector ``c`` at ``tokens`` (checked once, then timed)."""
    from kvflow.kernels import payload_bytes

    from .schema import make_row
    n = spec.num_blocks_for(tokens)
    ok = pair.check(src, dst)
    stats: list = []
    extra = {}
    agent = getattr(pair.sender, "agent", None)  # nixl: P's descriptors and post time
    before = (agent.descs_posted, agent.post_ms) if agent is not None else None
    times = time_calls([lambda: stats.append(pair.request(src, dst))],
                       warmup=opts["warmup"], reps=opts["reps"])
    if before is not None:  # per request, warm-up included
        extra["descs_per_request"] = (agent.descs_posted - before[0]) / len(stats)
        extra["post_ms"] = (agent.post_ms - before[1]) / len(stats)
    if connector_of(c)[1] == {"mode": "direct"}:  # NIXL's own WRITE of the same descriptors
        ts, descs = descs_ceiling(pair, src, dst, warmup=opts["warmup"], reps=opts["reps"])
        extra.update(descs_ceiling_ms=median(ts) * 1e3, descs_ceiling_descs=descs,
                     ratio_to_descs=median(ts) / median(times))
    if hasattr(stats[-1], "receive_ms"):  # D in its own process: its receive's wall time
        extra["d_receive_ms"] = median([s.receive_ms for s in stats[-len(times):]])
    return make_row(
        env, op="transfer", backend=c, spec=spec, tokens=tokens, blocks=n,
        payload_bytes=payload_bytes(spec, n), times_s=times, ceiling_s=ceiling_s,
        seed=opts["seed"], d_device=opts["d_device"], peer_process=opts["peer_process"],
        latency_ms_p50=percentile(times, 0.5) * 1e3,
        latency_ms_p99=percentile(times, 0.99) * 1e3,
        d_copy_ms=median([s.copy_ms for s in stats[-len(times):]]), verified=ok,
        ceiling=CEILINGS[c][1],
        config={"num_blocks": opts["num_blocks"], "reps": opts["reps"],
                "ids": opts.get("ids") or "random",
                "device": opts["device"], "preset": opts.get("preset")}, **extra)


def format_table(rows: list[dict]) -> str:
    """Text table: connector, tokens, MiB, GB/s, ratio to its ceiling, latency p50/p99 (ms),
    and for nixl the descriptors P posts per request, its ms in NIXL's post calls and (direct)
    the ratio to NIXL's own WRITE of that descriptor list."""
    head = (f"{'connector':13} {'tokens':>7} {'MiB':>8} {'GB/s':>8} {'ratio':>6} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'descs':>7} {'post ms':>8} {'/descs':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p50 = r.get("latency_ms_p50", r["time_s"] * 1e3)
        p99 = r.get("latency_ms_p99", r["time_s"] * 1e3)
        lines.append(f"{r['backend']:13} {r['tokens']:>7} {r['payload_bytes'] / 2**20:>8.1f} "
                     f"{r['gbps']:>8.2f} {r['ratio'] or 0:>6.2f} {p50:>8.2f} {p99:>8.2f}"
                     + (f" {r['descs_per_request']:>7.0f} {r['post_ms']:>8.3f}"
                        if "post_ms" in r else "")
                     + (f" {r['ratio_to_descs']:>6.2f}" if "ratio_to_descs" in r else "")
                     + ("" if r.get("verified", True) else "  MISMATCH"))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p)
    p.add_argument("--connectors", type=cli.csv(),
                   help=f"comma list of {','.join(KINDS)} (default: the preset's)")
    p.add_argument("--tokens", type=cli.tokens, help="request sizes in tokens")
    p.add_argument("--num-blocks", type=int, help="blocks per cache (quick 16, full 2048)")
    p.add_argument("--block-size", type=cli.positive_int, default=64,
                   help="tokens per block of the Llama-3-8B geometry (default 64)")
    p.add_argument("--ids", choices=("random", "contiguous"), default="random",
                   help="block ids of a request: random (fragmented, every block its own run) "
                        "or contiguous (one run on P and on D)")
    p.add_argument("--layout", choices=("NHD", "HND", "BM_NHD"), default="NHD",
                   help="cache layout of P and D (BM_NHD: block-major, one NIXL descriptor per "
                        "block; default NHD)")
    p.add_argument("--warmup", type=int, help="untimed requests per size")
    p.add_argument("--reps", type=int, help="timed requests per size")
    p.add_argument("--peer-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run D in its own process (default: on CUDA)")
    p.add_argument("--d-device", help="D's device (default: the second GPU when there are two, "
                                      "else P's device)")


def _peer_opts(opts: dict[str, Any]) -> None:
    """Fill ``peer_process`` and ``d_device`` (their defaults depend on the device)."""
    import torch
    dev = torch.device(opts["device"])
    if opts.get("peer_process") is None:
        opts["peer_process"] = dev.type == "cuda"
    if not opts.get("d_device"):
        two = dev.type == "cuda" and torch.cuda.device_count() > 1
        opts["d_device"] = "cuda:1" if two else (
            f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu")
    if dev.type == "cuda" and opts["device"] == "cuda":
        opts["device"] = "cuda:0"


def run(args) -> int:
    from .schema import env_info
    cli.require("zmq", "transfer")
    opts = cli.resolve(args, "transfer")
    unknown = [c for c in opts["connectors"] if c not in KINDS]
    if unknown:
        raise SystemExit(f"--connectors: unknown {', '.join(unknown)}; known: {', '.join(KINDS)}")
    _peer_opts(opts)
    env = env_info(opts["device"])
    t0 = time.perf_counter()
    rows, skipped = run_transfer(opts, env, progress=not args.no_progress)
    print(format_table(rows))
    for s in skipped:
        print(f"transfer: skipped {s['connector']}: {s['reason']}", file=sys.stderr)
    cli.finish(args, opts, env, rows, {"skipped": skipped}, t0=t0)
    return 0 if any(r["op"] == "transfer" for r in rows) else 1  # nothing measured: a failure
