"""The engine: a model plus one paged KV cache; prefill (whole, chunked, after a prefix hit),
batched decode, and the profile run.

Block tables are lists of physical block ids of ``cache`` (logical block ``i`` of the request
is ``block_table[i]``). The engine owns no allocator: the scheduler hands it tables.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import forward_context

from .attention import attend, dense_causal_attention, read_kv, write_kv
from .memory import measure_peak_bytes

# Prefill rows are padded to a multiple of this (see Engine._prefill_chunk).
ROW_TILE = 16


def check_unscaled(cache: PagedKVCache) -> None:
    """An fp8 ``cache`` must hold per-tensor scales of 1.0: the engine's attention
    (:mod:`.attention`) writes and reads fp8 K/V as plain values, without scales.

    Raises
    ------
    ValueError
        ``scales="block_head"``, or a per-tensor scale other than 1.0 (the first one named);
        e.g. ``cache.scales[3] is 0.5: the engine's attention writes and reads fp8 K/V
        without scales, so it runs fp8 caches with per-tensor scales of 1.0 only``.
    """
    if cache.scales is None:
        return
    tail = ("the engine's attention writes and reads fp8 K/V without scales, so it runs fp8 "
            "caches with per-tensor scales of 1.0 only")
    if cache.spec.scales == "block_head":
        raise ValueError(f"cache.spec.scales is 'block_head': {tail}")
    off = (cache.scales != 1.0).nonzero().flatten().tolist()  # once, at construction
    if off:
        raise ValueError(f"cache.scales[{off[0]}] is {cache.scales[off[0]].item()}: {tail}")


class Engine:
    """Runs ``model`` over ``cache``.

    Parameters
    ----------
    model : kvflow.model.LlamaForCausalLM
    cache : PagedKVCache
        Layout NHD or HND, with the model's num_layers, num_kv_heads and head_dim, on the
        model's device.

    Raises
    ------
    ValueError
        If the cache does not match the model (each differing field named with both values).
        Or an fp8 cache whose scales are not per-tensor 1.0 (:func:`check_unscaled`).
    """

    def __init__(self, model, cache: PagedKVCache) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        c, s = model.config, cache.spec
        diffs = [f"{n}: model {a} vs cache {b}" for n, a, b in
                 (("num_layers", c.num_layers, s.num_layers),
                  ("num_kv_heads", c.num_kv_heads, s.num_kv_heads),
                  ("head_dim", c.head_dim, s.head_dim)) if a != b]
        if s.view_layout not in ("NHD", "HND"):  # block-major BM_NHD: NHD views
            diffs.append(f"layout: model needs NHD, HND or BM_NHD, cache has {s.layout}")
        if cache.device != model.device:
            diffs.append(f"device: model {model.device} vs cache {cache.device}")
        if diffs:
            raise ValueError("cache does not match the model: " + "; ".join(diffs))
        check_unscaled(cache)
        self.model, self.cache, self.spec = model, cache, s
        self.device = model.device

    # ---- checks -----------------------------------------------------------------------
    def _table(self, name: str, block_table, num_tokens: int) -> torch.Tensor:
        bt = list(block_table)
        for b in bt:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.cache.num_blocks:
                raise ValueError(f"{name} holds block id {b!r}, not in [0, {self.cache.num_blocks})")
        need = self.spec.num_blocks_for(num_tokens)
        if len(bt) < need:
            raise ValueError(f"{name} has {len(bt)} blocks ({len(bt) * self.spec.block_size} tokens "
                             f"of block_size {self.spec.block_size}); {num_tokens} tokens need {need}")
        return torch.tensor(bt[:need], dtype=torch.long, device=self.device)

    def _tokens(self, name: str, ids) -> None:
        V = self.model.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                raise ValueError(f"{name} holds token id {t!r}, not in [0, {V})")

    # ---- prefill ----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: list[int], block_table: list[int], *, num_computed_tokens: int = 0,
                chunk_size: int | None = None,
                on_chunk: Callable[[int, int], Callable[[int], None] | None] | None = None
                ) -> torch.Tensor:
        """Compute K/V of ``token_ids[num_computed_tokens:]`` into the cache; return the float32
        logits [vocab_size] of the last token.

        Parameters
        ----------
        token_ids : list[int]
            The whole prompt (positions 0..n-1).
        block_table : list[int]
            Physical blocks of logical blocks 0..; must cover ``n`` tokens.
        num_computed_tokens : int
            Positions already in the cache (prefix hit or earlier chunks); attention reads them
            from the cache. ``0 <= num_computed_tokens < n``.
        chunk_size : int, optional
            Tokens per forward (chunked prefill); default: all remaining in one.
        on_chunk : callable(start, end) -> callable(layer) or None, optional
            Called before the forward of each chunk of positions ``[start, end)``; returns
            that chunk's per-layer hook, called as ``on_layer(layer)`` after each layer once
            its K/V are in the cache, or None. P's connector registers chunks and moves layers
            through it (:meth:`KVSender.begin <kvflow.connector.base.KVSender.begin>`), and
            P's serve heartbeats there; this loop is the only chunk loop.

        Raises
        ------
        ValueError
            Empty or out-of-vocab ``token_ids``; ``block_table`` too short or holding an id
            outside the cache; bad ``num_computed_tokens`` or ``chunk_size`` (each named).
        """
        n = len(token_ids)
        if n == 0:
            raise ValueError("token_ids must not be empty")
        if n > self.model.config.max_position_embeddings:
            raise ValueError(f"token_ids has {n} tokens; max_position_embeddings is "
                             f"{self.model.config.max_position_embeddings}")
        self._tokens("token_ids", token_ids)
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int) \
                or not 0 <= num_computed_tokens < n:
            raise ValueError(f"num_computed_tokens must be an int in [0, {n}), got {num_computed_tokens!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size <= 0):
            raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
        table = self._table("block_table", block_table, n)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        step = chunk_size or n
        for start in range(num_computed_tokens, n, step):
            end = min(start + step, n)
            hook = on_chunk(start, end) if on_chunk is not None else None
            hidden = self._prefill_chunk(ids[start:end], start, table, hook)
        return self.model.compute_logits(hidden[-1:])[0]

    def _prefill_chunk(self, ids, start, table, on_layer):
        # Rows are padded to a multiple of ROW_TILE (dummy tokens, never written, outputs
        # dropped) so the GEMM kernels see the same row tiling whatever the chunk length: with
        # chunk boundaries on multiples of ROW_TILE, chunked and prefix-hit prefills write
        # exactly the bytes of a one-shot prefill (measured on CPU; BLAS does not promise it).
        n = ids.numel()
        end, pad = start + n, -n % ROW_TILE
        bs, layout, dev = self.spec.block_size, self.spec.view_layout, self.device
        pos = torch.arange(start, end, device=dev)
        blocks, slots = table[pos // bs], pos % bs
        pos = torch.cat((pos, torch.full((pad,), start, device=dev)))
        ids = torch.cat((ids, torch.zeros(pad, dtype=ids.dtype, device=dev)))
        ctx_table = table[None, :self.spec.num_blocks_for(end)]
        mask = (torch.arange(end, device=dev)[None, :] <= pos[:, None])[None]

        def attn(layer, q, k, v):
            kc, vc = self.cache.layer(layer)
            write_kv(kc, vc, blocks, slots, k[:n], v[:n], layout)
            K = read_kv(kc, ctx_table, layout)[:, :end]
            V = read_kv(vc, ctx_table, layout)[:, :end]
            return attend(q[None], K, V, mask)[0]

        return self.model(ids, pos, attn, on_layer)[:n]

    # ---- decode -----------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, batch: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """One decode step for a batch of requests; float32 logits [B, vocab_size].

        Parameters
        ----------
        batch : list of (token_id, position, block_table)
            Each request's newest token, its position (= tokens already in the cache), and its
            block table (covering ``position + 1`` tokens). The token's K/V are written at
            ``position``; it attends to positions ``0..position`` of its own table.

        Raises
        ------
        ValueError
            Empty batch; bad token, position or block table (named with the batch index).
        """
        if not batch:
            raise ValueError("batch must hold at least one (token_id, position, block_table)")
        maxpos = self.model.config.max_position_embeddings
        tables, toks, poss = [], [], []
        for i, item in enumerate(batch):
            tok, pos, bt = item
            self._tokens(f"batch[{i}].token_id", [tok])
            if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < maxpos:
                raise ValueError(f"batch[{i}].position must be an int in [0, {maxpos}), got {pos!r}")
            tables.append(self._table(f"batch[{i}].block_table", bt, pos + 1))
            toks.append(tok)
            poss.append(pos)
        nb = max(t.numel() for t in tables)
        table = torch.zeros(len(batch), nb, dtype=torch.long, device=self.device)  # pad: block 0, masked
        for i, t in enumerate(tables):
            table[i, :t.numel()] = t
        ids = torch.tensor(toks, dtype=torch.long, device=self.device)
        pos = torch.tensor(poss, dtype=torch.long, device=self.device)
        bs, layout = self.spec.block_size, self.spec.view_layout
        rows = torch.arange(len(batch), device=self.device)
        blocks, slots = table[rows, pos // bs], pos % bs
        mask = (torch.arange(nb * bs, device=self.device)[None, :] <= pos[:, None])[:, None, :]

        def attn(layer, q, k, v):
            kc, vc = self.cache.layer(layer)
            write_kv(kc, vc, blocks, slots, k, v, layout)
            K, V = read_kv(kc, table, layout), read_kv(vc, table, layout)
            return attend(q[:, None], K, V, mask)[:, 0]

        return self.model.compute_logits(self.model(ids, pos, attn))

    # ---- profile run ------------------------------------------------------------------
    @torch.no_grad()
    def profile_run(self, max_num_batched_tokens: int) -> int:
        """Peak activation bytes of one forward of ``max_num_batched_tokens`` dummy tokens.

        Runs inside ``forward_context(is_dummy_or_profile_run=True)`` (so no channel is set up
        and nothing is signalled or sent) with dense attention over the step's own K/V: no
        cache block is written. Peak = bytes of tensors created during the forward and alive
        at once (CUDA: ``torch.cuda.max_memory_allocated`` above the start; CPU: tracked by
        :func:`kvflow.engine.memory.measure_peak_bytes`); weights and the cache excluded.

        Raises
        ------
        ValueError
            ``max_num_batched_tokens`` not a positive int or beyond max_position_embeddings.
        """
        n = max_num_batched_tokens
        maxpos = self.model.config.max_position_embeddings
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= maxpos:
            raise ValueError(f"max_num_batched_tokens must be an int in [1, {maxpos}], got {n!r}")
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        with forward_context(is_dummy_or_profile_run=True):
            return measure_peak_bytes(
                lambda: self.model.compute_logits(self.model(ids, pos, dense_causal_attention)[-1:]),
                self.device)
