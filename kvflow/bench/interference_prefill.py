"""P side of the interference study: prefill time with layerwise copies beside it vs alone.

One prompt of T tokens (random token ids) is prefilled by :class:`kvflow.engine.Engine` into
P's paged cache; with copies, the engine's ``on_chunk`` hook (the one P's connector uses)
returns an ``on_layer(l)`` that, once layer l's K/V are in the cache, submits
:func:`kvflow.kernels.copy_blocks` of layer l's blocks into a second cache on the same device
(D's, as an IPC push or pull) on the :class:`~.interference_lane.Lane`: on a GPU that copy runs
while layer l+1 computes. Reported per run: the prefill's seconds (launch to logits on the
host), the total (to the last copy's end) and whether D's blocks equal P's.
"""

from __future__ import annotations

import time

from .interference_lane import NONE, Config, Lane
from .interference_rows import HEAD, line, prefill_row, skipped_row


class PrefillBench:
    """An engine over ``model`` (on ``device``), P's cache, D's cache and one prompt per
    length (built once per run)."""

    def __init__(self, model, block_size: int, max_tokens: int, device) -> None:
        import torch

        from kvflow.cache import PagedKVCache
        from kvflow.engine import Engine
        self.dev, self.model = device, model
        self.spec = self.model.kv_spec(block_size)
        n = self.spec.num_blocks_for(max_tokens)
        self.p = PagedKVCache(self.spec, n, device)
        self.d = PagedKVCache(self.spec, n, device)
        self.engine = Engine(self.model, self.p)
        self.gen = torch.Generator(device="cpu").manual_seed(1)

    def prompt(self, tokens: int) -> None:
        """Use a new prompt of ``tokens`` tokens (its block tables on P and D: permutations)."""
        import torch
        nb = self.spec.num_blocks_for(tokens)
        self.tokens, self.nb = tokens, nb
        self.ids = torch.randint(0, self.model.config.vocab_size, (tokens,), generator=self.gen).tolist()
        src = torch.randperm(self.p.num_blocks, generator=self.gen)[:nb]
        dst = torch.randperm(self.d.num_blocks, generator=self.gen)[:nb]
        self.table = src.tolist()
        self.src, self.dst = src.to(self.dev), dst.to(self.dev)
        self.payload = nb * self.spec.bytes_per_block

    def copy(self, cfg: Config, layer) -> None:
        from kvflow.kernels import copy_blocks
        copy_blocks(self.p, self.d, self.src, self.dst, layers=layer, backend=cfg.backend,
                    max_ctas=cfg.max_ctas, validate=False)

    def run(self, cfg: Config, lane: Lane | None) -> dict:
        """One prefill of the current prompt; with ``lane`` (and a backend other than none),
        layer l's blocks are copied after layer l. Returns ``prefill_s``, ``total_s`` and
        ``landed`` (D's blocks equal P's; None without copies)."""
        import torch
        cuda = self.dev.type == "cuda"
        copies = lane is not None and cfg.backend != NONE

        def on_chunk(start, end):
            if not copies:
                return None
            return lambda layer: lane.submit(lambda: self.copy(cfg, layer), after_model=True)

        if copies:
            self.d.buffer.zero_()
        if cuda:
            torch.cuda.synchronize(self.dev)
        t0 = time.perf_counter()
        logits = self.engine.prefill(self.ids, self.table, on_chunk=on_chunk)
        logits.argmax().item()  # the first token on the host: the model's stream only
        t1 = time.perf_counter()
        if copies:
            lane.drain()
        t2 = time.perf_counter()
        landed = None
        if copies:
            landed = all(torch.equal(td[self.dst], tp[self.src])
                         for tp, td in zip(self.p.tensors(), self.d.tensors()))
        return {"prefill_s": t1 - t0, "total_s": t2 - t0, "landed": landed}

    def copies_alone(self, cfg: Config, reps: int) -> list[float]:
        """Seconds of the prompt's per-layer copies (every layer, one call each) with nothing
        beside them (:func:`kvflow.bench.timing.time_calls`)."""
        from .timing import time_calls
        layers = self.spec.num_layers
        return time_calls([lambda: [self.copy(cfg, i) for i in range(layers)]], device=self.dev,
                          warmup=1, reps=reps)


def prefill_side(o: dict, model, dev, cfgs: list[Config], env: dict, rows: list, sms: int) -> None:
    """The P side's rows, appended to ``rows`` as measured: a skipped row per configuration
    that cannot run, then per prompt length the prefill alone and one row per configuration.
    ``o``: the study's options (:func:`kvflow.bench.interference.options`)."""
    from .timing import copy_ceiling, median
    pb = PrefillBench(model, o["block_size"], max(o["prefill_tokens"]), dev)
    conf, seed = {"model": o["model"], "reps": o["reps"], "warmup": o["warmup"]}, o["seed"]
    print(HEAD["prefill"])

    def add(row):
        rows.append(row)
        print(line(row), flush=True)

    for cfg in [c for c in cfgs if c.skipped]:
        add(skipped_row(env, "prefill", cfg, pb.spec, sms, conf))
    for T in o["prefill_tokens"]:
        pb.prompt(T)
        ceil = median(copy_ceiling(pb.payload, device=dev, reps=10))
        alone = prefill_row(env, pb, Config(NONE), _runs(pb, Config(NONE), None, o), None, None,
                            None, sms, conf, seed)
        add(alone)
        for cfg in [c for c in cfgs if not c.skipped]:
            lane = Lane(dev)
            try:
                runs = _runs(pb, cfg, lane, o)
            finally:
                lane.close()
            copies = median(pb.copies_alone(cfg, reps=5))
            add(prefill_row(env, pb, cfg, runs, alone["prefill_s"], ceil, copies, sms, conf, seed))


def _runs(pb: PrefillBench, cfg: Config, lane, o: dict) -> list[dict]:
    """One or two untimed (``--warmup`` 0: none) then ``o["reps"]`` timed prefills of the
    current prompt."""
    for _ in range(min(2, o["warmup"])):
        pb.run(cfg, lane)
    return [pb.run(cfg, lane) for _ in range(o["reps"])]
