"""The served half of the ``ipc`` study: the same prompts served in every mode of
:data:`SERVE_MODES` (``python -m kvflow.serve`` on two GPUs, P on GPU 0 and D on GPU 1, and
colocated on GPU 0; on one GPU both on GPU 0; ``--device cpu`` on the CPU), each mode started
``--serve-starts`` times. Headline: TTFT(disagg) / TTFT(colocated) and the time to the second
token (TTST), medians over every prompt and start, with the per-hop breakdown of the responses'
``kvflow.hops_ms`` (:mod:`kvflow.bench.hops`); then TPOT, P's prefill time, transfer and exposed
transfer (push: P's wait for its copies after the first token + the ``KVPushed`` message; pull:
D's whole transfer), and token identity with colocated.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time

from . import cli

#: ``--layerwise-min-tokens`` above every prompt: the whole request moves after the prefill.
NO_LAYERWISE = ["--layerwise-min-tokens", str(1 << 30)]


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


def today_flags(args: str) -> str:
    """``server_args`` recorded with the removed ``--ipc-direction D --transfer-mode M`` in
    today's flags (``--kv-connector ipc-D`` and the ``--layerwise-min-tokens`` of
    :data:`SERVE_MODES`); any other string as it is."""
    import re
    return re.sub(r"--ipc-direction (push|pull) --transfer-mode (layerwise|request)",
                  lambda m: f"--kv-connector ipc-{m[1]} --layerwise-min-tokens "
                            f"{0 if m[2] == 'layerwise' else NO_LAYERWISE[1]}", args)


#: name -> (server mode, extra ``python -m kvflow.serve`` flags)
SERVE_MODES = {
    "push-layerwise": ("disagg", ["--kv-connector", "ipc-push", "--layerwise-min-tokens", "0"]),
    "push-request": ("disagg", ["--kv-connector", "ipc-push", *NO_LAYERWISE]),
    "pull-request": ("disagg", ["--kv-connector", "ipc-pull", *NO_LAYERWISE]),
    "pull-layerwise": ("disagg", ["--kv-connector", "ipc-pull", "--layerwise-min-tokens", "0"]),
    "nixl-layerwise": ("disagg", ["--kv-connector", "nixl", "--layerwise-min-tokens", "0"]),
    "nixl-request": ("disagg", ["--kv-connector", "nixl", *NO_LAYERWISE]),
    "nixl-staged": ("disagg", ["--kv-connector", "nixl", "--kv-connector-config",
                               '{"mode": "staged"}']),
    # block-major caches (BM_NHD): one NIXL descriptor per block (per layer group, layerwise)
    "nixl-bm-layerwise": ("disagg", ["--kv-connector", "nixl", "--kv-layout", "BM_NHD",
                                     "--layerwise-min-tokens", "0"]),
    "nixl-bm-request": ("disagg", ["--kv-connector", "nixl", "--kv-layout", "BM_NHD",
                                   *NO_LAYERWISE]),
    "colocated": ("colocated", []),
    "colocated-again": ("colocated", []),  # is the reference itself repeatable?
}
for _c in (4, 8, 32):  # the grid cap of the copies beside P's compute
    SERVE_MODES[f"push-layerwise-c{_c}"] = ("disagg", [
        "--kv-connector", "ipc-push", "--layerwise-min-tokens", "0", "--kv-connector-config",
        f'{{"max_ctas": {_c}}}'])
for _g in (1, 2, 8):  # layers per copy launch
    SERVE_MODES[f"push-layerwise-g{_g}"] = ("disagg", [
        "--kv-connector", "ipc-push", "--layerwise-min-tokens", "0", "--kv-connector-config",
        f'{{"layers_per_copy": {_g}}}'])
for _m in ("push-layerwise", "push-request", "pull-request", "colocated"):
    # KVFLOW_DEBUG_KV_DIGEST: D's prompt KV digest in the kvflow object (timings are off)
    SERVE_MODES[f"{_m}-digest"] = SERVE_MODES[_m]


def _serve_once(name: str, common: list[str], prompts: dict, a) -> dict:
    """One server start of mode ``name``: warm-up, then every prompt; {tokens: [results]}."""
    import httpx

    from .server import started_server
    mode, extra = SERVE_MODES[name]
    os.environ.pop("KVFLOW_DEBUG_KV_DIGEST", None)
    if name.endswith("-digest"):
        os.environ["KVFLOW_DEBUG_KV_DIGEST"] = "1"
    try:
        with started_server(mode, common + extra, timeout=240) as url:
            async def go():
                async with httpx.AsyncClient() as c:
                    first = a.serve_tokens[0]
                    for w in (256, first):  # warm-up (kernels, allocator)
                        await _complete(c, url, prompts[first][0][:w], 2)
                    return {T: [await _complete(c, url, p, a.max_tokens) for p in ps]
                            for T, ps in prompts.items()}
            return asyncio.run(go())
    finally:
        os.environ.pop("KVFLOW_DEBUG_KV_DIGEST", None)


def _start_row(make_row, env, name: str, T: int, rs: list, start: int, common: list) -> dict:
    """The row of one server start of mode ``name`` at ``T`` tokens, saved as it is measured
    (``serve_ipc_start``; pooled into ``serve_ipc_gpu`` rows once every start ran)."""
    kvs = [r["kvflow"] for r in rs]
    return make_row(env, op="serve_ipc_start", backend=name, spec=None, tokens=T, blocks=0,
                    payload_bytes=int(kvs[0].get("payload_bytes") or 0) if kvs else 0,
                    times_s=[float((kv.get("hops_ms") or {}).get("ttft", kv["ttft_ms"])) / 1e3
                             for kv in kvs],
                    ceiling_s=None, start=start + 1,
                    config={"server_args": shlex.join(common + SERVE_MODES[name][1])},
                    client_ttfts_ms=[r["ttft"] * 1e3 for r in rs],
                    token_ids=[r["text"] for r in rs], kvflow=kvs)


def _settle(rows: list, final: list) -> None:
    from .record import sink_of
    sink = sink_of(rows)
    if sink is not None:
        sink.settle(final)
    else:
        rows[:] = final


def run_serve(a, env, rows) -> None:
    """Serve the same prompts in every ``--serve-modes`` configuration, each started
    ``--serve-starts`` times (modes interleaved); headline TTFT(disagg) / TTFT(colocated) and
    TTST with a per-hop breakdown (:mod:`kvflow.bench.hops`), transfer and exposed transfer
    (push: P's wait for its copies after the first token + the KVPushed message; pull: D's
    whole transfer), token identity with colocated. Each start's row (``serve_ipc_start``) is
    saved as it is measured; once every start ran, the result file holds the pooled
    ``serve_ipc_gpu`` rows instead (a stop before that keeps the starts' rows)."""
    import random

    from . import hops
    from .schema import make_row
    from .timing import median
    maxlen = max(a.serve_tokens) + a.max_tokens + 64
    nb = 2 * (-(-maxlen // 64)) + 8
    common = ["--device", a.serve_device, "--model", a.model, "--dtype", a.serve_dtype,
              "--block-size", "64", "--num-blocks", str(nb), "--max-model-len", str(maxlen),
              "--max-num-batched-tokens", str(a.chunk), *getattr(a, "_gpu_args", []),
              *shlex.split(a.server_args)]
    rng = random.Random(0)
    prompts = {T: [[rng.randint(32, 126) for _ in range(T)] for _ in range(a.serve_reps)]
               for T in a.serve_tokens}
    modes = a.serve_modes.split(",")
    if "colocated" not in modes:
        modes.append("colocated")
    if any(m.endswith("-digest") for m in modes) and "colocated-digest" not in modes:
        modes.append("colocated-digest")
    for name in modes:
        if name not in SERVE_MODES:
            raise SystemExit(f"--serve-modes: unknown mode {name!r}; known: {', '.join(SERVE_MODES)}")
    outs: dict[str, dict[int, list]] = {}
    starts: dict[str, int] = {}
    for start in range(a.serve_starts):
        for name in modes:
            try:
                got = _serve_once(name, common, prompts, a)
            except Exception as exc:  # report and go on with the other modes
                print(f"serve mode {name} (start {start + 1}) FAILED: {type(exc).__name__}: {exc}")
                continue
            starts[name] = starts.get(name, 0) + 1
            for T, rs in got.items():
                outs.setdefault(name, {}).setdefault(T, []).extend(rs)
                rows.append(_start_row(make_row, env, name, T, rs, start, common))
    where = (f"P=GPU{a._gpus[0]} D=GPU{a._gpus[1]} vs colocated GPU{a._gpus[0]}"
             if a.serve_device == "cuda" else "on the CPU")
    print(f"\nserved {a.model} ({a.serve_dtype}, block 64, chunk {a.chunk}): disagg {where}; "
          f"{a.serve_reps} prompts x {a.serve_starts} server starts per length")
    groups, summary = [], []
    for T in a.serve_tokens:
        for name in [m for m in modes if m in outs]:
            rs = outs[name][T]
            ref = outs.get("colocated-digest" if name.endswith("-digest") else "colocated")
            n = len(prompts[T])  # results of each start follow one another: prompt i % n
            pairs = [(x, ref[T][i % n]) for i, x in enumerate(rs)] if ref is not None else []
            same = ref is not None and all(x["text"] == y["text"] for x, y in pairs)
            first_diff = [next((i for i, (u, v) in enumerate(zip(x["text"], y["text"])) if u != v),
                               None) for x, y in pairs]
            kvs = [r["kvflow"] for r in rs]
            groups.append({"tokens": T, "mode": name, "kvflows": kvs, "starts": starts[name],
                           "identical": same})

            def med(key):
                return median([float(kv.get(key) or 0) for kv in kvs])
            m = hops.hop_medians(kvs)
            client, tpot = median([r["ttft"] for r in rs]), median([r["tpot"] for r in rs])
            xfer = med("transfer_ms")
            # P writes (push, nixl): its wait after the first token; D pulls: the whole transfer
            exposed = med("exposed_ms") if name.startswith(("push", "nixl")) else xfer
            ttft = m.get("ttft") or med("ttft_ms")
            summary.append(make_row(env, op="serve_ipc_gpu", backend=name, spec=None, tokens=T, blocks=0,
                                 payload_bytes=int(kvs[0].get("payload_bytes") or 0),
                                 times_s=[float((kv.get("hops_ms") or {}).get("ttft", kv["ttft_ms"]))
                                          / 1e3 for kv in kvs],
                                 ceiling_s=None, client_ttft_ms=client * 1e3,
                                 config={"model": a.model, "starts": a.serve_starts,
                                         "server_args": shlex.join(common + SERVE_MODES[name][1])},
                                 ttft_ms=ttft, ttst_ms=m.get("ttst"), hops_ms=m,
                                 tpot_ms=tpot * 1e3, transfer_ms=xfer,
                                 exposed_ms=exposed, prefill_ms=med("prefill_ms"),
                                 copy_ms=med("copy_ms"), transfer_share=exposed / ttft if ttft else None,
                                 identical=same,
                                 client_ttfts_ms=[r["ttft"] * 1e3 for r in rs],
                                 token_ids=[r["text"] for r in rs], first_diff=first_diff,
                                 kvflow=kvs))
            if not same:
                print(f"  {T} {name}: NOT token-identical to colocated; first differing token "
                      f"per prompt: {first_diff}")
    # the result file holds the pooled rows in place of the per-start ones (the .partial.jsonl
    # keeps those as measured: a stop before this point leaves them in the result file)
    _settle(rows, [r for r in rows if r.get("op") != "serve_ipc_start"] + summary)
    print(hops.report(groups))
    print(f"  {'tokens':>6} {'mode':22} {'client':>8} {'TPOT ms':>8} {'xfer ms':>8} "
          f"{'exposed':>8}   (client: TTFT as httpx saw it)")
    for r in rows:
        if r.get("op") == "serve_ipc_gpu":
            print(f"  {r['tokens']:>6} {r['backend']:22} {r['client_ttft_ms']:8.2f} "
                  f"{r['tpot_ms']:8.3f} {r['transfer_ms']:8.3f} {r['exposed_ms']:8.3f}")


def add_serve_arguments(p) -> None:
    """The served runs' flags of the ``ipc`` study."""
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


def check_serve_arguments(a) -> None:
    for flag, v in (("--serve-reps", a.serve_reps), ("--serve-starts", a.serve_starts)):
        if v < 1:
            raise SystemExit(f"ipc: {flag} must be >= 1, got {v}")
