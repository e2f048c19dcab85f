"""D side of the interference study: TPOT of a decoding batch while new requests' KV lands in
the same paged cache.

The batch: ``batch`` running requests of ``context`` tokens each (their blocks filled with
random K/V: the cost of a decode step does not depend on the values), decoded step after step
by :class:`kvflow.engine.Engine` at fixed positions (each step writes the K/V of position
``context`` and attends to ``context + 1`` tokens, so every step does the same work); each
step feeds back the batch's greedy tokens (one device-to-host copy: the step's sync, on the
model's stream only). TPOT = host wall time of one step, launch to tokens on the host.

Arrivals: one unit is a new request of ``arrival_tokens`` tokens, all layers, landing in its
own blocks (``scatter``: :func:`kvflow.kernels.scatter_blocks` from a staging buffer, as a
receiver that staged the bytes; ``copy``: :func:`kvflow.kernels.copy_blocks` from a second cache
on the same device, as an IPC pull), on the :class:`~.interference_lane.Lane`. Pacing is by
credit: before each step, the units the target rate owes since the window opened are submitted
at once (as a receiver launches a request's scatter when its bytes are in); while
``max_inflight`` units are still unfinished, the units owed are forgone instead, so a rate the
backend cannot reach is reported at the rate it reached, not queued without end. Destinations rotate over ``pool`` unit-sized
block sets, sources over two, so each unit reads and writes memory, not L2.
"""

from __future__ import annotations

import dataclasses
import time

from .interference_lane import NONE, Config, Lane
from .interference_rows import HEAD, decode_row, line, skipped_row


@dataclasses.dataclass
class DecodeSetup:
    """The D side's sizes (tokens, blocks, steps); ``rate_gbps`` None means as fast as the lane
    takes (``max_inflight`` units always queued)."""

    model: str
    batch: int
    context: int
    block_size: int
    arrival_tokens: int
    arrival_op: str
    steps: int
    warmup: int
    pool: int
    max_inflight: int


class DecodeBench:
    """The batch, its engine over ``model`` (:func:`kvflow.model.load_model`'s, on
    ``device``), D's cache and the arrival sources (built once per run)."""

    def __init__(self, s: DecodeSetup, model, device) -> None:
        import torch

        from kvflow.cache import PagedKVCache, staging_buffer
        from kvflow.engine import Engine
        self.s, self.dev, self.model = s, device, model
        spec = self.spec = self.model.kv_spec(s.block_size)
        per_req = spec.num_blocks_for(s.context + 1)
        self.unit_blocks = spec.num_blocks_for(s.arrival_tokens)
        batch_blocks = s.batch * per_req
        self.cache = PagedKVCache(spec, batch_blocks + s.pool * self.unit_blocks, device)
        gen = torch.Generator(device="cpu").manual_seed(0)
        for t in self.cache.tensors():
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
                    if device.type == "cpu" else torch.randn_like(t))
        order = torch.randperm(batch_blocks, generator=gen).tolist()
        self.tables = [order[i * per_req:(i + 1) * per_req] for i in range(s.batch)]
        self.tokens = torch.randint(0, self.model.config.vocab_size, (s.batch,), generator=gen).tolist()
        self.engine = Engine(self.model, self.cache)
        pool = torch.arange(batch_blocks, self.cache.num_blocks).view(s.pool, self.unit_blocks)
        self.dst = [p.to(device) for p in pool]
        self.unit_bytes = spec.bytes_per_block * self.unit_blocks
        if s.arrival_op == "scatter":
            self.src = [staging_buffer(spec, self.unit_blocks, device=device).normal_() for _ in range(2)]
        else:
            self.src_cache = PagedKVCache(spec, 2 * self.unit_blocks, device)
            for t in self.src_cache.tensors():
                t.normal_()
            self.src = [torch.arange(i * self.unit_blocks, (i + 1) * self.unit_blocks, device=device)
                        for i in range(2)]
        self.n_units = 0

    def copy_fn(self, cfg: Config, k: int):
        """The call that lands unit ``k`` (destination set ``k % pool``, source ``k % 2``)."""
        from kvflow.kernels import copy_blocks, scatter_blocks
        dst, src = self.dst[k % len(self.dst)], self.src[k % 2]
        if self.s.arrival_op == "scatter":
            return lambda: scatter_blocks(src, self.cache, dst, backend=cfg.backend,
                                          max_ctas=cfg.max_ctas, validate=False)
        return lambda: copy_blocks(self.src_cache, self.cache, src, dst, backend=cfg.backend,
                                   max_ctas=cfg.max_ctas, validate=False)

    def landed(self, k: int) -> bool:
        """Unit ``k``'s blocks in D's cache equal its source, byte for byte (call after
        :meth:`Lane.drain`)."""
        import torch
        dst, src = self.dst[k % len(self.dst)], self.src[k % 2]
        got = torch.stack([t[dst] for t in self.cache.tensors()])
        if self.s.arrival_op == "scatter":
            return torch.equal(got.view(src.shape), src)
        want = torch.stack([t[src] for t in self.src_cache.tensors()])
        return torch.equal(got, want)

    def step(self) -> None:
        """One decode step of the whole batch; its tokens become the next step's."""
        batch = [(tok, self.s.context, table) for tok, table in zip(self.tokens, self.tables)]
        self.tokens = self.engine.decode(batch).argmax(-1).tolist()

    def measure(self, cfg: Config, rate_gbps: float | None, steps: int | None = None) -> dict:
        """TPOT of ``steps`` (default ``s.steps``) steps after ``s.warmup``, with units arriving
        at ``rate_gbps`` GB/s (0 or ``cfg.backend == "none"``: none). Returns seconds per step
        (``tpot_s``), units landed, the window's seconds (first step's start to the last unit's
        end or the last step's end, whichever is later) and whether the last unit landed intact."""
        lane = Lane(self.dev) if cfg.backend != NONE and rate_gbps != 0 else None
        try:
            return self._measure(lane, cfg, rate_gbps, steps or self.s.steps)
        finally:
            if lane is not None:
                lane.close()

    def _measure(self, lane, cfg, rate_gbps, steps: int) -> dict:
        s = self.s
        for _ in range(s.warmup):  # compiles, allocator; arrivals on too when they run
            if lane is not None and lane.pending() < s.max_inflight:
                lane.submit(self.copy_fn(cfg, self.n_units))
                self.n_units += 1
            self.step()
        if lane is not None:
            lane.drain()
        first, issued, credited, tpot = self.n_units, 0, 0, []
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            if lane is not None:
                busy = lane.pending()
                owed = (s.max_inflight - busy if rate_gbps is None else
                        int(rate_gbps * 1e9 * (t - t0) / self.unit_bytes) - credited)
                credited += max(0, owed)
                for _ in range(owed if busy < s.max_inflight else 0):
                    lane.submit(self.copy_fn(cfg, self.n_units))
                    self.n_units += 1
                    issued += 1
            self.step()
            tpot.append(time.perf_counter() - t)
        if lane is not None:
            lane.drain()
        window = time.perf_counter() - t0
        ok = self.landed(self.n_units - 1) if issued else None
        return {"tpot_s": tpot, "units": issued, "forgone": credited - issued, "window_s": window,
                "landed": ok}


def decode_side(o: dict, model, dev, cfgs: list[Config], env: dict, rows: list, sms: int) -> None:
    """The D side's rows, appended to ``rows``: the baseline, a skipped row per configuration
    that cannot run, one row per (rate > 0, configuration), the baseline again. Each configuration
    runs ``steps / rounds`` steps per round, in that order, for ``rounds`` rounds (so host and
    clock drift falls on all alike); its row pools its rounds; ratios are to the first baseline.
    ``o``: the study's options (:func:`kvflow.bench.interference.options`)."""
    from .timing import copy_ceiling, median, time_calls
    s = DecodeSetup(**{f.name: o[f.name] for f in dataclasses.fields(DecodeSetup)})
    b = DecodeBench(s, model, dev)
    conf = {k: o[k] for k in ("model", "batch", "context", "arrival_tokens", "arrival_op",
                              "steps", "warmup", "max_inflight", "pool")}
    ceil_unit = median(copy_ceiling(b.unit_bytes, device=dev, rotations=2, reps=10))
    print(HEAD["decode"])
    none, seed = Config(NONE), o["seed"]

    def add(row):
        rows.append(row)
        print(line(row), flush=True)

    run = [c for c in cfgs if not c.skipped]
    alone = {cfg: median(time_calls([b.copy_fn(cfg, k) for k in range(s.pool)], device=dev,
                                    warmup=2, reps=10)) for cfg in run}
    plan = ([("first", none, 0.0)] + [("swept", cfg, rate) for rate in o["kv_rate_gbs"]
                                        if rate != 0 for cfg in run] + [("last", none, 0.0)])
    got: list[list[dict]] = [[] for _ in plan]
    rounds = o["rounds"]
    per = [s.steps // rounds + (i < s.steps % rounds) for i in range(rounds)]
    for n in per:  # every configuration a slice of its steps per round: drift hits each alike
        for k, (_, cfg, rate) in enumerate(plan):
            got[k].append(b.measure(cfg, rate, n))
    base = None
    for (phase, cfg, rate), res in zip(plan, got):
        row = decode_row(env, b, cfg, rate, _pooled(res), base, None if cfg is none else ceil_unit,
                         alone.get(cfg), sms, dict(conf, phase=phase, rounds=rounds), seed)
        base = base or row
        add(row)
        if phase == "first":
            for skipped in [c for c in cfgs if c.skipped]:
                add(skipped_row(env, "decode", skipped, b.spec, sms, conf))


def _pooled(parts: list[dict]) -> dict:
    """One :meth:`DecodeBench.measure` result of a configuration's rounds: steps and units
    summed, ``landed`` True only if every round's last unit landed."""
    landed = [p["landed"] for p in parts if p["landed"] is not None]
    return {"tpot_s": [t for p in parts for t in p["tpot_s"]],
            "units": sum(p["units"] for p in parts), "forgone": sum(p["forgone"] for p in parts),
            "window_s": sum(p["window_s"] for p in parts),
            "landed": all(landed) if landed else None}
