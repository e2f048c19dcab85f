"""Block allocator, request lifecycles, admission."""

import threading

import pytest

from kvflow.blocks import (AdmissionError, BlockAllocator, ColocatedState, DecodeState,
                          IllegalTransitionError, NoFreeBlocksError, Request,
                          admission_check)


def test_allocate_free_counts():
    a = BlockAllocator(8)
    x = a.allocate(3)
    assert x == [0, 1, 2] and (a.num_free, a.num_used, a.num_blocks) == (5, 3, 8)
    y = a.allocate(5)
    assert sorted(x + y) == list(range(8)) and a.num_free == 0
    a.free(x)
    assert a.num_free == 3 and a.allocate(2) == [0, 1]
    assert a.allocate(0) == []


def test_allocate_too_many_allocates_nothing():
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(NoFreeBlocksError, match=r"^requested 2 blocks but only 1 of 4 are free$"):
        a.allocate(2)
    assert a.num_free == 1


@pytest.mark.parametrize("n", [-1, 1.5, True, "2"])
def test_allocate_bad_n(n):
    with pytest.raises(ValueError, match=r"^n must be a non-negative int, got "):
        BlockAllocator(4).allocate(n)


def test_double_free_and_unknown_id_change_nothing():
    a = BlockAllocator(4)
    ids = a.allocate(2)
    with pytest.raises(ValueError, match=r"^double free of block id 1: 1 reference\(s\), 2 free\(s\)$"):
        a.free([0, 1, 1])
    assert a.num_free == 2 and a.ref_count(0) == 1
    with pytest.raises(ValueError, match=r"^block id 4 is not in \[0, 4\)$"):
        a.free([0, 4])
    assert a.ref_count(0) == 1
    a.free(ids)
    with pytest.raises(ValueError, match=r"^double free of block id 0: 0 reference\(s\), 1 free\(s\)$"):
        a.free([0])
    assert a.num_free == 4


def test_shared_prefix_refcounts():
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.incref(ids[:1])
    assert a.ref_count(ids[0]) == 2
    a.free(ids)
    assert a.num_free == 3 and a.ref_count(ids[0]) == 1
    a.free(ids[:1])
    assert a.num_free == 4
    with pytest.raises(ValueError, match=r"^block id 0 is free; incref needs an allocated block$"):
        a.incref([0])


def test_bad_num_blocks():
    with pytest.raises(ValueError, match=r"^num_blocks must be a positive int, got 0$"):
        BlockAllocator(0)


def test_thread_safety():
    a = BlockAllocator(64)
    seen, lock = [], threading.Lock()

    def work():
        for _ in range(200):
            ids = a.allocate(3)
            with lock:
                seen.append(tuple(ids))
            a.free(ids)

    ts = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert a.num_free == 64 and len(seen) == 800
    assert all(a.ref_count(i) == 0 for i in range(64))


def test_colocated_lifecycle_and_illegal_moves():
    r = Request(request_id="r1", prompt_token_ids=[1, 2, 3], max_tokens=4, role="colocated")
    assert r.state is ColocatedState.WAITING
    with pytest.raises(IllegalTransitionError,
                       match=r"^request r1: illegal colocated transition WAITING -> DECODING; "
                             r"allowed: \['ABORTED', 'FAILED', 'PREFILLING', 'TIMED_OUT'\]$"):
        r.transition(ColocatedState.DECODING)
    for s in (ColocatedState.PREFILLING, ColocatedState.DECODING, ColocatedState.DONE):
        r.transition(s)
    assert r.finished and r.finish_time is not None
    with pytest.raises(IllegalTransitionError, match=r"allowed: none \(terminal\)$"):
        r.transition(ColocatedState.FAILED)


def test_prefill_role_has_no_request():
    with pytest.raises(ValueError, match=r"role must be one of \['colocated', 'decode'\], got 'prefill'"):
        Request(request_id="p", prompt_token_ids=[1], max_tokens=1, role="prefill")


def test_decode_lifecycle_timeout_and_foreign_state():
    r = Request(request_id="d", prompt_token_ids=[1], max_tokens=2, role="decode")
    assert r.state is DecodeState.ALLOCATED
    with pytest.raises(IllegalTransitionError, match="ALLOCATED -> DECODING"):
        r.transition(DecodeState.DECODING)  # D must receive the KV first
    r.transition(DecodeState.RECEIVING)
    r.transition(DecodeState.TIMED_OUT, error="P did not send within 5 s")
    assert r.finished and r.error == "P did not send within 5 s"
    r2 = Request(request_id="x", prompt_token_ids=[1], max_tokens=1, role="decode")
    with pytest.raises(IllegalTransitionError):
        r2.transition(ColocatedState.PREFILLING)
    c = Request(request_id="c", prompt_token_ids=[1], max_tokens=1)
    for s in (ColocatedState.PREFILLING, ColocatedState.DECODING, ColocatedState.DONE):
        c.transition(s)
    assert c.finished


def test_decode_replaces_block_table_from_prefill():
    from_p = [7, 8, 9, 10, 11]  # P's ids for 70 tokens of block 16, meaningless on D
    r = Request(request_id="r", prompt_token_ids=list(range(70)), max_tokens=10, role="decode",
                block_table=from_p)
    a = BlockAllocator(32)
    need = admission_check(len(r.prompt_token_ids), r.max_tokens, max_model_len=128,
                           num_blocks=a.num_blocks, block_size=16)
    r.set_block_table(a.allocate(need))
    assert need == 5 and r.block_table == [0, 1, 2, 3, 4] and len(r.block_table) == need
    assert from_p == [7, 8, 9, 10, 11]  # the incoming list is not mutated or extended


def test_ttft_tpot():
    r = Request(request_id="t", prompt_token_ids=[1], max_tokens=3, arrival_time=10.0)
    assert r.ttft is None and r.tpot is None
    for t, tok in ((10.5, 5), (10.7, 6), (11.1, 7)):
        r.append_token(tok, now=t)
    assert r.ttft == pytest.approx(0.5) and r.tpot == pytest.approx(0.3)
    assert r.prompt_token_ids + r.output_token_ids == [1, 5, 6, 7] and r.num_tokens == 4


def test_request_bad_input():
    with pytest.raises(ValueError, match=r"^role must be one of \['colocated', 'decode'\], got 'x'$"):
        Request(request_id="a", prompt_token_ids=[1], max_tokens=1, role="x")
    with pytest.raises(ValueError, match=r"^max_tokens must be a positive int, got 0$"):
        Request(request_id="a", prompt_token_ids=[1], max_tokens=0)
    with pytest.raises(ValueError, match=r"^prompt_token_ids must not be empty$"):
        Request(request_id="a", prompt_token_ids=[], max_tokens=1)


def test_admission():
    assert admission_check(100, 28, max_model_len=128, num_blocks=8, block_size=16) == 8
    with pytest.raises(AdmissionError, match=r"^prompt \(100 tokens\) \+ max_tokens \(29\) = 129 "
                                             r"exceeds max_model_len=128$"):
        admission_check(100, 29, max_model_len=128, num_blocks=100, block_size=16)
    with pytest.raises(AdmissionError, match=r"^prompt \(100 tokens\) \+ max_tokens \(28\) needs 8 "
                                             r"blocks of 16 tokens; the cache has 7$"):
        admission_check(100, 28, max_model_len=4096, num_blocks=7, block_size=16)
    with pytest.raises(ValueError, match=r"^block_size must be a positive int, got 0$"):
        admission_check(1, 1, max_model_len=8, num_blocks=1, block_size=0)


@pytest.mark.parametrize("prompt_len, max_tokens, max_model_len, num_blocks, param", [
    (100, 29, 128, 100, "max_tokens"), (128, 1, 128, 100, "prompt"),   # max_model_len
    (100, 28, 4096, 7, "max_tokens"), (113, 1, 4096, 7, "prompt"),     # D's blocks
])
def test_admission_blames_the_prompt_only_when_it_alone_cannot_fit(prompt_len, max_tokens,
                                                                   max_model_len, num_blocks, param):
    with pytest.raises(AdmissionError) as exc:
        admission_check(prompt_len, max_tokens, max_model_len=max_model_len,
                        num_blocks=num_blocks, block_size=16)
    assert exc.value.param == param
