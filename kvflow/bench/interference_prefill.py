"""P side of the interference study: prefill time with layerwise copies beside it vs alone.

One prompt of T tokens (random token ids) is prefilled by :class:`kvflow.engine.Engine` into
P's paged cache; with copies, the engine's ``on_chunk`` hook is ipc-push's own
(:class:`kvflow.connector.layer_copy.LayerCopier`): after each group of ``--layers-per-copy``
layers (default the connector's, 4) it launches :func:`kvflow.kernels.copy_blocks` of that
group's blocks into a second cache on the same device (D's), on a copy stream behind an event of
the model's stream, grid capped at ``max_ctas`` (the last group uncapped, as served). Reported
per run: the prefill's seconds (launch to logits on the host), the total (to the last copy's
end) and whether D's blocks equal P's.
"""

from __future__ import annotations

import time

from .interference_lane import NONE, Config
from .interference_rows import HEAD, line, prefill_row, skipped_row


class PrefillBench:
    """An engine over ``model`` (on ``device``), P's cache, D's cache and one prompt per
    length (built once per run)."""

    def __init__(self, model, block_size: int, max_tokens: int, device,
                 layers_per_copy: int = 1) -> None:
        import torch

        from kvflow.cache import PagedKVCache
        from kvflow.engine import Engine
        self.dev, self.model, self.layers_per_copy = device, model, layers_per_copy
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
        self.table, self.dst_table = src.tolist(), dst.tolist()
        self.src, self.dst = src.to(self.dev), dst.to(self.dev)
        self.payload = nb * self.spec.bytes_per_block

    def copy(self, cfg: Config, layers) -> None:
        from kvflow.kernels import copy_blocks
        copy_blocks(self.p, self.d, self.src, self.dst, layers=layers, backend=cfg.backend,
                    max_ctas=cfg.max_ctas, validate=False)

    def copier(self, cfg: Config):
        """ipc-push's :class:`~kvflow.connector.layer_copy.LayerCopier` for ``cfg`` (None for
        no transfer)."""
        from kvflow.connector.layer_copy import LayerCopier
        if cfg.backend == NONE:
            return None
        return LayerCopier(self.p, cfg.backend, cfg.max_ctas, self.layers_per_copy)

    def run(self, copier) -> dict:
        """One prefill of the current prompt; with ``copier`` (:meth:`copier`), each group of
        layers' blocks is copied after that group. Returns ``prefill_s``, ``total_s`` and
        ``landed`` (D's blocks equal P's; None without copies)."""
        import torch

        from kvflow.connector.layer_copy import PushStats
        stats = PushStats(dst=self.d)
        if copier is not None:
            self.d.buffer.zero_()
            pairs = copier.pairs(self.table, self.dst_table, 0, self.nb, 0, self.d)
            copier.start()
        on_chunk = None if copier is None else (lambda s, e: copier.layer_hook(pairs, stats, True))
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        t0 = time.perf_counter()
        logits = self.engine.prefill(self.ids, self.table, on_chunk=on_chunk)
        logits.argmax().item()  # the first token on the host: the model's stream only
        t1 = time.perf_counter()
        if copier is not None:
            copier.finish()
        t2 = time.perf_counter()
        landed = None if copier is None else all(
            torch.equal(td[self.dst], tp[self.src])
            for tp, td in zip(self.p.tensors(), self.d.tensors()))
        return {"prefill_s": t1 - t0, "total_s": t2 - t0, "landed": landed}

    def copies_alone(self, cfg: Config, reps: int) -> list[float]:
        """Seconds of the prompt's copies (one call per group of ``layers_per_copy`` layers)
        with nothing beside them (:func:`kvflow.bench.timing.time_calls`)."""
        from .timing import time_calls
        L, G = self.spec.num_layers, self.layers_per_copy
        return time_calls([lambda: [self.copy(cfg, (i, min(i + G, L))) for i in range(0, L, G)]],
                          device=self.dev, warmup=1, reps=reps)


def prefill_side(o: dict, model, dev, cfgs: list[Config], env: dict, rows: list, sms: int) -> None:
    """The P side's rows, appended to ``rows`` as measured: a skipped row per configuration
    that cannot run, then per prompt length the prefill alone and one row per configuration.
    ``o``: the study's options (:func:`kvflow.bench.interference.options`)."""
    from .timing import copy_ceiling, median
    pb = PrefillBench(model, o["block_size"], max(o["prefill_tokens"]), dev,
                      o["layers_per_copy"])
    conf, seed = {"model": o["model"], "reps": o["reps"], "warmup": o["warmup"],
                  "layers_per_copy": o["layers_per_copy"]}, o["seed"]
    print(HEAD["prefill"])

    def add(row):
        rows.append(row)
        print(line(row), flush=True)

    for cfg in [c for c in cfgs if c.skipped]:
        add(skipped_row(env, "prefill", cfg, pb.spec, sms, conf))
    for T in o["prefill_tokens"]:
        pb.prompt(T)
        ceil = median(copy_ceiling(pb.payload, device=dev, reps=10))
        alone = prefill_row(env, pb, Config(NONE), _runs(pb, None, o), None, None, None, sms,
                            conf, seed)
        add(alone)
        for cfg in [c for c in cfgs if not c.skipped]:
            copier = pb.copier(cfg)
            try:
                runs = _runs(pb, copier, o)
            finally:
                copier.close()
            copies = median(pb.copies_alone(cfg, reps=5))
            add(prefill_row(env, pb, cfg, runs, alone["prefill_s"], ceil, copies, sms, conf, seed))


def _runs(pb: PrefillBench, copier, o: dict) -> list[dict]:
    """One or two untimed (``--warmup`` 0: none) then ``o["reps"]`` timed prefills of the
    current prompt."""
    for _ in range(min(2, o["warmup"])):
        pb.run(copier)
    return [pb.run(copier) for _ in range(o["reps"])]
