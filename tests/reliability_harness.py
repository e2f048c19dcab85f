"""An in-process P + D pair for the reliability tests: real PrefillInstance / DecodeInstance
objects (model, caches, allocators, ipc shared-memory cache) whose messages are captured
instead of sent, and delivered by the test one by one — every interleaving is deterministic."""

from __future__ import annotations

from kvflow.connector.messages import KVAck, LeaseRenew
from kvflow.serve.protocol import Abort, Allocate, Pair, Prefill, decode, encode
from kvflow.connector import Peer
from kvflow.serve.instance.decode import DecodeInstance
from kvflow.serve.launch.config import ServeConfig
from kvflow.serve.instance.prefill import PrefillInstance

ROUTER = "tcp://127.0.0.1:9"  # never reached: every send is captured


class FakeLink:
    """P's link to D: records the frames P's sender writes."""

    def __init__(self) -> None:
        self.frames: list[list] = []

    def send(self, frame, *a, **k):
        self.frames.append([frame])

    def send_multipart(self, frames, *a, **k):
        self.frames.append([bytes(f) if isinstance(f, memoryview) else f for f in frames])

    def close(self, *a):
        pass


def capture(inst, out: list) -> None:
    def send(sock, msg, *, ident=None):
        encode(msg)  # every captured message must be encodable
        out.append(msg)
    inst.send = send


def make_instance(cls, role: str, **kw):
    cfg = ServeConfig(role=role, router_url=ROUTER,
                      kv_connector=kw.pop("kv_connector", "ipc-pull"),
                      layerwise_min_tokens=kw.pop("layerwise_min_tokens", 1 << 30),
                      num_blocks=kw.pop("num_blocks", 48),
                      max_model_len=kw.pop("max_model_len", 256),
                      max_num_batched_tokens=256, **kw)
    inst = cls(cfg)
    out: list = []
    capture(inst, out)
    inst.startup()
    inst.out = out
    return inst


class PD:
    """P and D paired over ipc; ``run`` drives one request from Allocate to its last token."""

    def __init__(self, *, prefix: bool = True, d_blocks: int = 48, lease_s: float = 5.0,
                 kv_connector: str = "ipc-pull", **cfg) -> None:
        """``cfg``: more :class:`ServeConfig` fields of both, e.g. ``decode_block_size``."""
        self.p = make_instance(PrefillInstance, "prefill", kv_lease_s=lease_s,
                               kv_connector=kv_connector, **cfg)
        self.d = make_instance(DecodeInstance, "decode", num_blocks=d_blocks,
                               kv_connector=kv_connector, enable_prefix_caching=prefix,
                               kv_lease_s=lease_s, **cfg)
        # driven by hand: D's loop renews (captured, delivered by renew()), not its thread
        self.d.beats.stop()
        self.d.beats = None
        self.link = FakeLink()  # what P sends to D (ipc-push: P also maps D's exported cache)
        self.p.connector.attach(Peer(self.d.instance_id, self.d.spec, self.d.num_blocks,
                                     **self.d.receiver.export()), link=self.link)
        self.d.on_pair(Pair(peer_id=self.p.instance_id, peer_role="prefill",
                            peer_spec=self.p.spec.to_dict(), peer_num_blocks=self.p.num_blocks,
                            shm_name=self.p.connector.export().get("shm_name", ""),
                            peer_connector_md=self.p.connector.export().get("connector_md", b""),
                            peer_fingerprint=self.p.fingerprint), [], None)
        assert self.d.out[-1].ok, self.d.out[-1]
        self.n = 0
        self.max_tokens: dict[str, int] = {}  # per request, for P's Prefill (its stop rule)

    def close(self) -> None:
        for inst in (self.p, self.d):
            inst.close()

    def free(self) -> tuple[int, int]:
        return self.p.allocator.num_free, self.d.free_blocks()

    def take(self, inst, kind):
        """Messages of ``kind`` ``inst`` sent (taken). ``take(d, Tokens)`` is the router's view:
        P's first tokens (``index`` 0, sent as soon as P sampled them) with D's, each request's
        in output order."""
        msgs = self.own(inst, kind)
        if inst is self.d and kind.__name__ == "Tokens":
            msgs = self.own(self.p, kind) + msgs
            order = {}
            for m in msgs:
                order.setdefault(m.req_id, len(order))
            msgs.sort(key=lambda m: (order[m.req_id], m.index))
        return msgs

    @staticmethod
    def own(inst, kind):
        msgs = [m for m in inst.out if isinstance(m, kind)]
        inst.out[:] = [m for m in inst.out if not isinstance(m, kind)]
        return msgs

    def allocate(self, token_ids, max_tokens=8, req_id=None):
        self.n += 1
        req_id = req_id or f"r{self.n}"
        self.d.on_allocate(Allocate(req_id=req_id, token_ids=token_ids, max_tokens=max_tokens,
                                    ignore_eos=True), [], None)
        self.max_tokens[req_id] = max_tokens
        return req_id, self.d.out.pop()

    def prefill(self, req_id, token_ids, allocated):
        """P prefills and sends; returns (P's full block table, the sent frames decoded)."""
        self.p.on_prefill(Prefill(req_id=req_id, token_ids=token_ids, decode_id=self.d.instance_id,
                                  decode_block_ids=allocated.block_ids,
                                  num_cached_blocks=allocated.num_cached_blocks,
                                  max_tokens=self.max_tokens.get(req_id, 0), ignore_eos=True),
                          [], None)
        table = None
        real = self.p.allocator.allocate
        def spy(n):  # P's table, also when its sender frees the blocks at once (tcp)
            nonlocal table
            table = real(n)
            return table
        self.p.allocator.allocate = spy
        try:
            self.p.work()
        finally:
            del self.p.allocator.allocate
        frames = self.link.frames.pop()
        return table, decode(frames[0]), frames[1:]

    def deliver(self, header, frames=()):
        """Hand P's transfer to D; D's KVAck (if any) goes back to P."""
        self.d.on_data(header, list(frames), self.p.instance_id.encode())
        for ack in self.take(self.d, KVAck):
            self.p.on_data(ack, [], None)

    def renew(self):
        for msg in self.take(self.d, LeaseRenew):
            self.p.on_data(msg, [], None)

    def abort(self, req_id, peer_dead="", prefill_sent=True, peer_exited=False):
        for inst in (self.p, self.d):
            inst.on_abort(Abort(req_id=req_id, peer_dead=peer_dead, prefill_sent=prefill_sent,
                                peer_exited=peer_exited), [], None)

    def decode_all(self):
        while self.d.has_work():
            self.d.work()

    def run(self, token_ids, max_tokens=8):
        req_id, alloc = self.allocate(token_ids, max_tokens)
        p_table, header, frames = self.prefill(req_id, token_ids, alloc)
        self.deliver(header, frames)
        self.decode_all()
        from kvflow.serve.protocol import Tokens
        toks = [m for m in self.take(self.d, Tokens) if m.req_id == req_id]
        return alloc, p_table, header, toks


def time_out_on_d(pd: PD, token_ids, timeout_s: float = 0.1):
    """Allocate on D and let D's receive timeout (set to ``timeout_s``; the caller restores it)
    end the request before any KV came; returns ``(req_id, D's final Tokens)``."""
    import time

    from kvflow.serve.protocol import Tokens
    pd.d.receive_timeout_s = timeout_s
    req, _ = pd.allocate(token_ids)
    time.sleep(1.5 * timeout_s)
    pd.d.heartbeat(force=True)
    (end,) = [m for m in pd.own(pd.d, Tokens) if m.req_id == req]
    return req, end


def every_block_back(pd: PD):
    """Body of an autouse fixture: the test starts with every block free (prefix cache empty)
    and must end with nothing queued, pending, in flight or lent and every block free again."""
    pd.d.prefix.clear()
    start = pd.free()
    assert start == (pd.p.num_blocks, pd.d.num_blocks)
    yield
    assert not pd.p.pending and not pd.p.queue and not pd.d.seqs and not pd.d.receiver.inflight
    assert not pd.d.lent
    pd.d.prefix.clear()
    assert pd.free() == start


def greedy_tokens(model, spec, token_ids, max_tokens: int = 8) -> list[int]:
    """The reference of the served tests: greedy tokens of one engine of ``spec`` doing the
    prefill and the decode in one cache (no transfer)."""
    from kvflow import PagedKVCache
    from kvflow.engine import Engine
    from kvflow.serve.instance.sampling import sample_token
    eng = Engine(model, PagedKVCache(spec, 32))
    table = list(range(-(-(len(token_ids) + max_tokens) // spec.block_size)))
    out = [sample_token(eng.prefill(token_ids, table), 0.0, 0, 0)]
    while len(out) < max_tokens:
        logits = eng.decode([(out[-1], len(token_ids) + len(out) - 1, table)])
        out.append(sample_token(logits[0], 0.0, 0, len(out)))
    return out
