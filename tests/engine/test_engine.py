"""Paged engine vs a dense full-recompute reference (kvflow-tiny, float32, CPU)."""

import random

import pytest
import torch

from kvflow import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.engine import Engine, determine_num_blocks, sample
from kvflow.engine.attention import reference_logits
from kvflow.model import load_model

PROMPT = "Paged attention keeps the KV cache in blocks; the decode instance reads them back."
ATOL = 2e-5  # measured max |paged - dense| ~3e-6 on logits of std ~1


@pytest.fixture(scope="module")
def tiny():
    return load_model("kvflow-tiny")


def fresh(model, num_blocks=48, block_size=16, layout="NHD"):
    cache = PagedKVCache(model.kv_spec(block_size, layout=layout), num_blocks)
    return Engine(model, cache), cache


def generate(engine, ids, table, steps):
    """Greedy: prefill then `steps` decode steps; returns (tokens, logits of each step)."""
    logits = [engine.prefill(ids, table)]
    seq = list(ids)
    for _ in range(steps):
        seq.append(sample(logits[-1], 0.0))
        logits.append(engine.decode([(seq[-1], len(seq) - 1, table)])[0])
    return seq[len(ids):], logits


@pytest.mark.parametrize("layout", ["NHD", "HND", "BM_NHD"])
def test_paged_greedy_equals_dense_reference(tiny, layout):
    model, tok = tiny
    ids = tok.encode(PROMPT)
    rng = random.Random(0)
    table = rng.sample(range(48), 8)  # non-contiguous, shuffled
    engine, _ = fresh(model, layout=layout)
    toks, logits = generate(engine, ids, table, 8)
    seq = list(ids)
    for step, lg in enumerate(logits):
        ref = reference_logits(model, seq)[-1]
        torch.testing.assert_close(lg, ref, atol=ATOL, rtol=0)
        assert sample(lg, 0.0) == sample(ref, 0.0)
        if step < len(toks):
            seq.append(toks[step])
    assert len(set(toks)) > 1  # a real continuation, not one repeated token


def test_cache_holds_dense_kv(tiny):
    """The K of layer 0 in the cache equals k_proj + RoPE of the prompt, slot by slot."""
    model, tok = tiny
    ids = tok.encode("abcdefghijklmnopqrstu")  # 22 tokens: 2 blocks of 16
    engine, cache = fresh(model)
    engine.prefill(ids, [5, 2])
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(torch.tensor(ids)))
    from kvflow.model.llama import apply_rope
    cos, sin = model.rope_table()[: len(ids)].unbind(1)
    k = apply_rope(layer.self_attn.k_proj(x).view(len(ids), 2, 32), cos, sin)
    K = cache.layer(0)[0]
    torch.testing.assert_close(K[5], k[:16].detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(K[2, :6], k[16:].detach(), atol=1e-6, rtol=0)
    assert K[2, 6:].abs().sum() == 0 and K[0].abs().sum() == 0  # nothing else written


def test_block_major_cache_holds_the_bytes_of_the_layer_major_one(tiny):
    """The same prefill into an NHD and a BM_NHD cache: every layer's K and V are equal bit for
    bit, block by block (only where the bytes lie differs)."""
    model, tok = tiny
    ids, table = tok.encode(PROMPT), [7, 3, 11, 0, 5, 9]
    (e1, c1), (e2, c2) = fresh(model), fresh(model, layout="BM_NHD")
    assert torch.equal(e1.prefill(ids, table), e2.prefill(ids, table))
    for a, b in zip(c1.tensors(), c2.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk", [16, 32, 48])
def test_chunked_prefill_exact_bytes_on_tile_boundaries(tiny, chunk):
    model, tok = tiny
    ids = tok.encode(PROMPT)
    table = list(range(10, 16))
    e1, c1 = fresh(model)
    e2, c2 = fresh(model)
    l1 = e1.prefill(ids, table)
    l2 = e2.prefill(ids, table, chunk_size=chunk)
    assert torch.equal(l1, l2)
    assert torch.equal(c1.buffer, c2.buffer)


@pytest.mark.parametrize("chunk", [1, 7, 25])
def test_chunked_prefill_any_chunk_size(tiny, chunk):
    """Off the 16-row tiles BLAS may round differently: bytes agree to fp32 rounding."""
    model, tok = tiny
    ids = tok.encode(PROMPT)[:30]
    table = list(range(10, 12))
    e1, c1 = fresh(model)
    e2, c2 = fresh(model)
    l1 = e1.prefill(ids, table)
    l2 = e2.prefill(ids, table, chunk_size=chunk)
    torch.testing.assert_close(l2, l1, atol=ATOL, rtol=0)
    for a, b in zip(c1.tensors(), c2.tensors()):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    assert sample(l1, 0.0) == sample(l2, 0.0)


def test_prefix_reuse_equals_full_prefill(tiny):
    """Blocks 0-2 of the prompt are already in the cache (a prefix hit): prefill only the rest."""
    model, tok = tiny
    ids = tok.encode(PROMPT)
    table = [30, 4, 17, 8, 41, 2]
    e1, c1 = fresh(model)
    full = e1.prefill(ids, table)
    e2, c2 = fresh(model)
    e2.prefill(ids[:48], table[:3])  # an earlier request with the same 48-token prefix
    before = c2.buffer.clone()
    hit = e2.prefill(ids, table, num_computed_tokens=48)
    assert torch.equal(full, hit) and torch.equal(c1.buffer, c2.buffer)
    # the prefix blocks were read, not rewritten
    for t_now, t_old in zip(c2.tensors(), PagedKVCache(c2.spec, 48, buffer=before).tensors()):
        assert torch.equal(t_now[table[:3]], t_old[table[:3]])


def test_batched_decode_equals_one_at_a_time(tiny):
    model, tok = tiny
    prompts = [tok.encode(p) for p in ("Hi", PROMPT, "A medium length prompt here, about forty tokens.")]
    tables = [[0], [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    eb, cb = fresh(model)
    es, cs = fresh(model)
    batch = []
    for ids, table in zip(prompts, tables):
        lg = eb.prefill(ids, table)
        es.prefill(ids, table)
        batch.append((sample(lg, 0.0), len(ids), table))
    for _ in range(3):
        out_b = eb.decode(batch)
        out_s = torch.stack([es.decode([item])[0] for item in batch])
        torch.testing.assert_close(out_b, out_s, atol=ATOL, rtol=0)
        torch.testing.assert_close(cb.buffer.view(torch.float32), cs.buffer.view(torch.float32),
                                   atol=ATOL, rtol=0)
        batch = [(sample(out_b[i], 0.0), p + 1, t) for i, (_, p, t) in enumerate(batch)]
        assert [b[0] for b in batch] == [sample(out_s[i], 0.0) for i in range(3)]


def test_on_chunk_once_per_chunk_its_layer_hook_once_per_layer(tiny):
    model, tok = tiny
    ids = tok.encode(PROMPT)
    engine, _ = fresh(model)
    calls = []

    def on_chunk(start, end):
        calls.append((start, end))
        return calls.append if start else None  # the first chunk: no per-layer hook

    engine.prefill(ids, list(range(6)), chunk_size=32, on_chunk=on_chunk)
    n = len(ids)
    want = [(0, min(32, n))]
    for start in range(32, n, 32):
        want += [(start, min(start + 32, n)), 0, 1, 2, 3]
    assert n > 64 and calls == want


def test_layer_hook_sees_layer_written(tiny):
    model, tok = tiny
    engine, cache = fresh(model)
    written = []
    engine.prefill(tok.encode("hello"), [3], on_chunk=lambda start, end: lambda l: written.append(
        [bool(t[3].abs().sum() > 0) for t in cache.tensors()]))
    assert written[0] == [True, True] + [False] * 6
    assert written[3] == [True] * 8


def test_profile_run_writes_nothing_sends_nothing(tiny, monkeypatch):
    model, _ = tiny
    engine, cache = fresh(model, num_blocks=4)
    cache.buffer.copy_(torch.randint(0, 255, cache.buffer.shape, dtype=torch.uint8))
    before = cache.buffer.clone()
    flags = []
    layer0 = model.model.layers[0]
    orig = type(layer0).forward

    def spy(self, *a, **k):
        flags.append(sends_allowed())
        return orig(self, *a, **k)

    monkeypatch.setattr(type(layer0), "forward", spy)
    peak = engine.profile_run(256)
    assert flags == [False] * 4 and sends_allowed()
    assert torch.equal(cache.buffer, before)
    # the [256, 512] MLP intermediates alone are 3 x 512 KiB alive at once
    assert 1_500_000 < peak < 50_000_000
    assert engine.profile_run(512) > peak


def test_determine_num_blocks(tiny):
    model, _ = tiny
    spec = model.kv_spec(16)
    from kvflow.engine.profile import weight_bytes
    budget = 64 << 20
    n = determine_num_blocks(model, spec, memory_budget_bytes=budget, max_num_batched_tokens=128,
                             device="cpu")
    peak = fresh(model)[0].profile_run(128)
    assert n == (budget - weight_bytes(model) - peak) // spec.bytes_per_block
    with pytest.raises(ValueError, match=r"^memory_budget_bytes=10000000 leaves -?\d+ bytes for the KV "
                                         r"cache after weights \(\d+ B\) and peak activations"):
        determine_num_blocks(model, spec, memory_budget_bytes=10_000_000,
                             max_num_batched_tokens=128)


def test_bad_input_named_before_work(tiny):
    model, tok = tiny
    engine, cache = fresh(model, num_blocks=8)
    ids = tok.encode(PROMPT)
    with pytest.raises(ValueError, match=r"^block_table has 5 blocks \(80 tokens of block_size 16\); "
                                         r"83 tokens need 6$"):
        engine.prefill(ids, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"^block_table holds block id 8, not in \[0, 8\)$"):
        engine.prefill(ids, [0, 1, 2, 3, 4, 8])
    with pytest.raises(ValueError, match=r"^num_computed_tokens must be an int in \[0, 83\), got 83$"):
        engine.prefill(ids, list(range(6)), num_computed_tokens=83)
    with pytest.raises(ValueError, match=r"^token_ids holds token id 258, not in \[0, 258\)$"):
        engine.prefill([1, 258], [0])
    with pytest.raises(ValueError, match=r"^batch\[1\].block_table has 1 blocks .*; 17 tokens need 2$"):
        engine.decode([(1, 0, [0]), (1, 16, [1])])
    assert cache.buffer.abs().sum() == 0
    bad = PagedKVCache(model.kv_spec(16).with_(head_dim=64), 2)
    with pytest.raises(ValueError, match=r"^cache does not match the model: head_dim: model 32 vs cache 64$"):
        Engine(model, bad)


def test_fp8_cache_needs_per_tensor_scales_of_one(tiny):
    """The attention writes and reads fp8 K/V without scales (issue #19): a cache whose scales
    would change the values is refused, never read as if they were 1.0."""
    model, _ = tiny
    tail = ("the engine's attention writes and reads fp8 K/V without scales, so it runs fp8 "
            "caches with per-tensor scales of 1.0 only")
    fp8 = model.kv_spec(16, dtype=torch.float8_e4m3fn)
    Engine(model, PagedKVCache(fp8, 2))  # a new cache's scales are 1.0
    with pytest.raises(ValueError) as e:
        Engine(model, PagedKVCache(fp8.with_(scales="block_head"), 2))
    assert str(e.value) == f"cache.spec.scales is 'block_head': {tail}"
    cache = PagedKVCache(fp8, 2)
    cache.scales[3] = 0.5
    with pytest.raises(ValueError) as e:
        Engine(model, cache)
    assert str(e.value) == f"cache.scales[3] is 0.5: {tail}"
