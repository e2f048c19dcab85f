"""Issue 14 kind 7: a request id that is already live is refused, on P (a second ``Prefill``
while the first is queued or its blocks are held for D) and on D (a second ``Allocate`` while
the first is live or its blocks are lent to P). The first request completes token-identical
to colocated, D hears nothing of the refused one, and every block comes back (in-process P + D,
tests/reliability_harness.py). The router never sends a duplicate: it names every request
itself (``cmpl-`` + uuid4), whatever the client sends."""

from __future__ import annotations

import pytest

from kvflow.serve.protocol import Abort, Allocate, Prefill, Rejected, Tokens

from tests.reliability_harness import PD
from tests.serve.test_reliability_pd import TEXT, colocated, tokens_of

SETUPS = {"ipc-pull": dict(), "tcp": dict(kv_connector="tcp"), "ipc-push": dict(kv_connector="ipc-push")}


@pytest.fixture(params=list(SETUPS))
def pd(request):
    h = PD(prefix=False, **SETUPS[request.param])
    start = h.free()
    yield h
    assert not h.p.pending and not h.p.queue and not h.d.seqs and not h.d.lent
    assert h.free() == start == (h.p.num_blocks, h.d.num_blocks)
    h.close()


def p_refusal(pd, req):
    return (f"request id {req} is already live on prefill instance {pd.p.instance_id}; a second "
            f"Prefill with it is refused")


def test_second_prefill_with_a_live_id_is_refused_and_nothing_leaks(pd):
    prompt = TEXT[:40]
    req, alloc = pd.allocate(prompt)
    msg = Prefill(req_id=req, token_ids=prompt, decode_id=pd.d.instance_id,
                  decode_block_ids=alloc.block_ids)
    pd.p.on_prefill(msg, [], None)
    pd.p.on_prefill(msg, [], None)                        # while the first is queued
    (rej,) = pd.take(pd.p, Rejected)
    assert (rej.req_id, rej.kind, rej.error) == (req, "error", p_refusal(pd, req))
    assert len(pd.p.queue) == 1 and not pd.link.frames    # D heard nothing of the second
    pd.p.work()
    if pd.p.pending:                                      # pull / tcp: held until D's ack
        pd.p.on_prefill(msg, [], None)
        (rej,) = pd.take(pd.p, Rejected)
        assert rej.error == p_refusal(pd, req) and not pd.p.queue
    (frames,) = pd.link.frames
    pd.link.frames.clear()
    from kvflow.serve.protocol import decode
    pd.deliver(decode(frames[0]), frames[1:])
    pd.decode_all()
    assert tokens_of(pd.take(pd.d, Tokens)) == colocated(pd, prompt)


def test_second_allocate_with_a_live_id_is_refused_and_nothing_leaks(pd):
    prompt = TEXT[:40]
    req, alloc = pd.allocate(prompt)
    free = pd.d.free_blocks()
    pd.d.on_allocate(Allocate(req_id=req, token_ids=prompt, max_tokens=8), [], None)
    (rej,) = pd.take(pd.d, Rejected)
    assert (rej.req_id, rej.kind) == (req, "error")
    assert rej.error == (f"request id {req} is already live on decode instance "
                         f"{pd.d.instance_id}; a second Allocate with it is refused")
    assert pd.d.free_blocks() == free
    if pd.p.connector.name != "ipc-push":
        pd.abort(req)
        return
    # push: the request ends on D while its Prefill is queued on P: D's blocks are lent to P
    pd.p.on_prefill(Prefill(req_id=req, token_ids=prompt, decode_id=pd.d.instance_id,
                            decode_block_ids=alloc.block_ids), [], None)
    pd.d.on_abort(Abort(req_id=req, prefill_sent=True), [], None)
    assert req in pd.d.lent
    pd.d.on_allocate(Allocate(req_id=req, token_ids=prompt, max_tokens=8), [], None)
    (rej,) = pd.take(pd.d, Rejected)
    assert rej.error.startswith(f"request id {req} is already live on decode instance")
    pd.p.on_abort(Abort(req_id=req), [], None)            # P: nothing more will be written
    (frames,) = pd.link.frames
    pd.link.frames.clear()
    from kvflow.serve.protocol import decode
    pd.deliver(decode(frames[0]))                         # D frees the lent blocks
