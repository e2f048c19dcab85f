"""The report's table of each bench kind's rows (contention, transfer, copy_sequence between
two specs, the served load generator), one function each; :mod:`kvflow.bench.report` lays
them out per result file."""

from __future__ import annotations

from typing import Any

from .kernel_report import md_table as _md_table


def fmt(v: Any, spec: str = ".2f") -> str:
    """``v`` for a table cell: ``-`` for None, floats by ``spec``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def contention_table(rows: list[dict]) -> list[str]:
    body = [[r["backend"], r["tokens"], fmt(r["max_ctas"]), r["prefill_tokens"],
             r["prefill_alone_ms"], r["prefill_beside_ms"], f"{r['slowdown'] * 100:.1f}%",
             r["copy_alone_gbps"]] for r in rows]
    return ["**SM contention**: prefill matmul alone vs beside a background gather", ""] + _md_table(
        ["backend", "copy tokens", "max_ctas", "prefill tokens", "alone ms", "beside ms",
         "slowdown", "copy GB/s alone"], body)


def transfer_table(rows: list[dict]) -> list[str]:
    """Connector rows beside their ceilings; a NIXL ceiling names its descriptor size, a file
    whose D ran in its own process gives D's receive time and device, and nixl rows their
    layout, descriptors and post ms per request and (direct) the ratio of NIXL's own WRITE of
    that descriptor list to the request."""
    def ceiling(r: dict) -> str:
        if "chunk_bytes" in r:
            return f"fastest bulk WRITE: {r['chunk_bytes'] // 1024} KiB descriptors"
        return r.get("ceiling", "-")
    body = [[r["backend"], r["tokens"], r["payload_bytes"] / 2**20, r["gbps"], r["ratio"],
             ceiling(r), r.get("latency_ms_p50", r["time_s"] * 1e3),
             r.get("latency_ms_p99", r["time_s"] * 1e3)] for r in rows]
    head = ["connector", "tokens", "MiB", "GB/s", "ratio", "ceiling", "p50 ms", "p99 ms"]
    if any(r.get("peer_process") for r in rows):
        head += ["D receive ms", "D device"]
        for line, r in zip(body, rows):
            line += [r.get("d_receive_ms", "-"), r.get("d_device", "-")]
    if any("descs_per_request" in r for r in rows):
        head += ["layout", "descs", "post ms", "NIXL's own / request"]
        for line, r in zip(body, rows):
            line += [r.get("layout", "-"), r.get("descs_per_request", "-"), r.get("post_ms", "-"),
                     r.get("ratio_to_descs", "-")]
    return _md_table(head, body)


def reblock_table(rows: list[dict]) -> list[str]:
    """copy_sequence between two specs (``python -m kvflow.bench reblock``): both sides' bytes,
    as called and device time, and the ratios to the same-run copy_ ceiling of the bytes
    written, of the bytes read, and of the copy's memory traffic."""
    body = [[r["case"], r["tokens"], r["src_bytes"] / 2**20, r["dst_bytes"] / 2**20,
             r["time_s"] * 1e6, r["gbps"], r["ratio"], r["ratio_read"], r["ratio_traffic"],
             r["device_ratio"]] for r in rows]
    return (["**copy_sequence between two specs**, as called (back-to-back calls, default "
             "arguments); GB/s of bytes written; ratios to the same-run copy_ ceiling of the "
             "bytes written (the headline), of the bytes read, and of the memory traffic; the "
             "last column is the written ratio in device time.", ""]
            + _md_table(["case", "tokens", "read MiB", "write MiB", "us/call", "GB/s written",
                         "ratio", "ratio read", "ratio traffic", "device ratio"], body))


def serve_table(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        body.append([r["backend"], fmt(r.get("rate")), f"{r['completed']}/{r['requests']}"]
                    + [f"{fmt(r[f'{m}_ms_mean'], '.1f')} / {fmt(r[f'{m}_ms_p50'], '.1f')} / "
                       f"{fmt(r[f'{m}_ms_p90'], '.1f')} / {fmt(r[f'{m}_ms_p99'], '.1f')}"
                       for m in ("ttft", "tpot", "itl", "e2e")]
                    + [r["throughput_rps"], r["output_tok_s"], r["goodput_rps"], r["slo_attainment"]])
    slo = rows[0] if rows else {}
    return ([f"Latencies in ms as mean / p50 / p90 / p99. Goodput: requests/s meeting TTFT <= "
             f"{slo.get('slo_ttft_ms')} ms and TPOT <= {slo.get('slo_tpot_ms')} ms (DistServe).", ""]
            + _md_table(["mode", "rate req/s", "done", "TTFT", "TPOT", "ITL", "E2E", "req/s",
                         "out tok/s", "goodput req/s", "SLO attainment"], body))
