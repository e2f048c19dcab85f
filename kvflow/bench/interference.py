"""What moving KV costs the model sharing the device: decode TPOT and prefill time beside copies.

D side (:mod:`.interference_decode`): a batch of running requests decodes step after step
while new requests' KV lands in the same paged cache at ``--kv-rate-gbs`` (scatter or copy of
their blocks on a second CUDA stream, paced by credit), for every copy configuration: the
``triton`` backend at each ``--max-ctas``, ``copy_engine`` (skipped, with the reason in its
row, where :mod:`kvflow.kernels.registry` lacks it), and ``none``, the no-transfer baseline
(measured first and again last: the second says how far the device drifted). Per row: TPOT
p50/p99 and their ratio to the baseline, the KV GB/s achieved and its ratio to the same-run
``copy_`` ceiling of the same bytes, one unit copied alone, the SMs the copies may occupy.

P side (:mod:`.interference_prefill`): prefill of ``--prefill-tokens`` prompts alone, then with
layer l's blocks copied (same configurations) while layer l+1 computes; prefill ratio.

Rows: :mod:`.interference_rows` (fields), saved as measured (:mod:`kvflow.bench.record`); the
plot of TPOT ratio vs KV GB/s, with device, versions, commit and date, is written next to the
result file (``.png``). Defaults depend on ``--device``: on ``cuda`` kvflow-llama-32l (bf16),
32 requests at 1K context, 1K-token arrivals, 0/25/50/100 GB/s, prompts of 1K/4K/8K (about
2 minutes on one H200); on ``cpu`` kvflow-tiny (float32) at tiny sizes (seconds): there the
copies run on a worker thread on the same cores, which checks the machinery, not a GPU's
interference.
"""

from __future__ import annotations

import argparse
import sys

from . import cli

#: Defaults per device type (flags given win).
DEFAULTS = {
    "cuda": dict(model="kvflow-llama-32l", dtype="bfloat16", batch=32, context=1024,
                 block_size=64, arrival_tokens=1024, kv_rate_gbs=[0.0, 25.0, 50.0, 100.0],
                 max_ctas=[4, 16, 64, None], backends=["triton", "copy_engine"], steps=600,
                 warmup=10, prefill_tokens=[1024, 4096, 8192], reps=10, pool=4, max_inflight=4,
                 layers_per_copy=4, rounds=10),
    "cpu": dict(model="kvflow-tiny", dtype="float32", batch=3, context=48, block_size=16,
                arrival_tokens=64, kv_rate_gbs=[0.0, 0.05, 0.2], max_ctas=[None],
                backends=["torch", "copy_engine"], steps=12, warmup=2, prefill_tokens=[32, 64],
                reps=1, pool=2, max_inflight=4, layers_per_copy=4,
                rounds=2),
}


def rates(text: str) -> list[float | None]:
    """Parser of ``--kv-rate-gbs``: GB/s values >= 0, comma-separated; ``max`` (None) keeps the
    copy lane full."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() == "max":
            out.append(None)
            continue
        try:
            v = float(item)
        except ValueError:
            v = -1.0
        if not v >= 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r} is not a rate in GB/s >= 0 (e.g. 0,25,50,100 or max)")
        out.append(v)
    return out


def ctas(text: str) -> list[int | None]:
    """Parser of ``--max-ctas``: positive ints, or ``full`` (None: the whole grid)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() == "full":
            out.append(None)
            continue
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r} is not a CTA count >= 1 or 'full' (e.g. 4,16,64,full)")
        out.append(int(item))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p, presets=False)
    p.add_argument("--side", choices=("decode", "prefill", "both"), default="both",
                   help="which side to measure (default both)")
    p.add_argument("--model", help="built-in model (cuda: kvflow-llama-32l; cpu: kvflow-tiny)")
    p.add_argument("--batch", type=int, help="running requests of the decode batch (cuda 32)")
    p.add_argument("--context", type=int, help="tokens of each running request (cuda 1024)")
    p.add_argument("--block-size", type=int, help="tokens per block (cuda 64)")
    p.add_argument("--arrival-tokens", type=int,
                   help="tokens of one arriving request: the unit the rate is paced in (cuda 1024)")
    p.add_argument("--arrival-op", choices=("scatter", "copy"), default="scatter",
                   help="how arrivals land: scatter_blocks from a staging buffer, or copy_blocks "
                        "from a second cache (default scatter)")
    p.add_argument("--kv-rate-gbs", type=rates, metavar="GBS",
                   help="KV arrival rates in GB/s, 0 = baseline, max = lane always full "
                        "(cuda 0,25,50,100)")
    p.add_argument("--max-ctas", type=ctas, help="grid caps of triton's copies (cuda 4,16,64,full)")
    p.add_argument("--backends", type=cli.csv(),
                   help="copy backends (cuda triton,copy_engine; cpu torch,copy_engine); "
                        "'none', the baseline, is always measured")
    p.add_argument("--steps", type=int, help="timed decode steps per row (cuda 600)")
    p.add_argument("--rounds", type=int,
                   help="D side: rounds each row's steps are split over, rows interleaved in "
                        "each round (cuda 10)")
    p.add_argument("--warmup", type=int, help="untimed decode steps or prefills first (cuda 10)")
    p.add_argument("--prefill-tokens", type=cli.tokens, help="P side prompt lengths (cuda 1K,4K,8K)")
    p.add_argument("--reps", type=int, help="timed prefills per length and configuration (cuda 10)")
    p.add_argument("--layers-per-copy", type=int,
                   help="P side: layers per copy launch, as ipc-push's layers_per_copy (default 4)")
    p.add_argument("--pool", type=int, help="destination block sets the arrivals rotate over")
    p.add_argument("--max-inflight", type=int, help="arrival units queued at most (default 4)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")


def options(args) -> dict:
    """The device's :data:`DEFAULTS` overlaid with the flags given (checked: SystemExit naming
    the flag and value)."""
    dev = args.device
    if dev is not None:
        cli.check_device("interference", dev)
    else:
        import torch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    opts = dict(DEFAULTS["cpu" if dev == "cpu" else "cuda"])
    opts.update({k: v for k, v in vars(args).items() if not k.startswith("_") and v is not None})
    opts["device"] = dev
    for key in ("batch", "context", "block_size", "arrival_tokens", "steps", "pool", "max_inflight",
                "reps", "layers_per_copy", "rounds"):
        if isinstance(opts[key], bool) or not isinstance(opts[key], int) or opts[key] < 1:
            raise SystemExit(f"kvflow.bench interference: --{key.replace('_', '-')} "
                             f"{opts[key]!r}: must be an int >= 1")
    if opts["rounds"] > opts["steps"]:
        raise SystemExit(f"kvflow.bench interference: --rounds {opts['rounds']!r}: must be <= "
                         f"--steps ({opts['steps']})")
    if opts["warmup"] < 0:
        raise SystemExit(f"kvflow.bench interference: --warmup {opts['warmup']!r}: must be >= 0")
    if opts.get("threads"):
        cli.set_threads(opts["threads"])
    return opts


def run(args) -> int:
    import torch

    from kvflow.model import load_model

    from .interference_decode import decode_side
    from .interference_lane import configs
    from .interference_prefill import prefill_side
    from .interference_rows import plot
    from .schema import env_info, result_path
    o = options(args)
    dev, dtype = torch.device(o["device"]), getattr(torch, o["dtype"])
    torch.manual_seed(o["seed"])
    cfgs = configs(o["backends"], o["max_ctas"], dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
    env = env_info(dev)
    rows = cli.rows(env, o)
    model, _ = load_model(o["model"], dtype=dtype, device=dev)
    if o["side"] in ("decode", "both"):
        decode_side(o, model, dev, cfgs, env, rows, sms)
    if o["side"] in ("prefill", "both"):
        prefill_side(o, model, dev, cfgs, env, rows, sms)
    bad = [r for r in rows if r.get("landed") is False]
    extra = {}
    if not o["no_plot"] and o["side"] != "prefill":
        png = result_path(o["out_dir"], o.get("name") or "interference", env).with_suffix(".png")
        try:
            extra["plot"] = plot(list(rows), env, png).name  # beside the result file
        except ImportError as exc:
            print(f"interference: no plot ({exc}); pip install 'kvflow[bench]'", file=sys.stderr)
    cli.finish(args, o, env, rows, extra_env=extra)
    if extra.get("plot"):
        print(f"wrote {png}")
    if bad:
        print(f"interference: {len(bad)} rows' copied blocks differ from their source: "
              f"{[r['label'] for r in bad]}", file=sys.stderr)
        return 1
    return 0
