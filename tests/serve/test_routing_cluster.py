"""Issue 14 kinds 2 and 3 with separately started processes (`--role router|prefill|decode`,
ipc, tests/serve/test_reliability_peers.py's Cluster): one P with two D's, then two P's with the two
D's. Requests are spread over every D (and, with two, every P) and all are token-identical to
a colocated engine. A third D serving another checkpoint of the same shapes (other weights)
is refused at pairing, visibly in /health, and never gets a request. Every process serves
checkpoints of kvflow-tiny's shapes with one tokenizer (the router refuses another)."""

from __future__ import annotations

import concurrent.futures

import pytest

from kvflow.model import load_model
from kvflow.model.loader import SEED
from kvflow.serve.instance.fingerprint import model_fingerprint

from tests.serve.test_pairing_fingerprint import save_checkpoint
from tests.serve.test_reliability_peers import Cluster
from tests.serve.test_routing_mesh import MAX_TOKENS, colocated, prompt


class SlowCluster(Cluster):
    """Every instance (and the router, which tokenizes) serves ``model`` unless told another
    ``--model``; the router declares an instance dead after 10 s without a heartbeat, not 1 s:
    2 shared CI cores can make a prefill that long."""

    def __init__(self, model: str) -> None:
        self.model_dir = model
        super().__init__()

    def spawn(self, role, *args, env=None):
        if role == "router":
            args = (*args, "--dead-after-s", "10")  # argparse: the last one counts
        if "--model" not in args:
            args = (*args, "--model", self.model_dir)
        return super().spawn(role, *args, env=env)


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    # kvflow-tiny's weights and another draw of the same shapes, with one tokenizer: the router
    # (on the first) admits both D's, and P refuses the other at pairing
    root = tmp_path_factory.mktemp("ckpt")
    same, other = save_checkpoint(root / "same", seed=SEED), save_checkpoint(root / "other", seed=1)
    c = SlowCluster(same)
    try:
        c.p = [c.spawn("prefill")]
        c.d = [c.spawn("decode", "--receive-timeout-s", "10") for _ in range(2)]
        c.d_other, c.other = c.spawn("decode", "--model", other), other
        c.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 4
               and len(c.inst(c.p[0].pid, h)["paired_with"]) == 2, 150, "P paired with both D's")
        c.model = load_model("kvflow-tiny")[0]
        yield c
    finally:
        c.close()


def run(cl, first: int, n: int = 8) -> list[dict]:
    """``n`` requests (prompts ``first..``), 4 at a time; each checked against colocated."""
    def one(i):
        r = cl.complete(prompt=prompt(i), max_tokens=MAX_TOKENS, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == colocated(cl.model, prompt(i)), i
        return r.json()["kvflow"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(first, first + n)))


def test_one_p_two_d_every_d_serves_and_other_weights_are_refused(cl):
    p, other = cl.inst(cl.p[0].pid), cl.inst(cl.d_other.pid)
    ds = sorted(cl.inst(d.pid)["id"] for d in cl.d)
    kvs = run(cl, 0)
    assert sorted({kv["decode_instance"] for kv in kvs}) == ds          # each D served some
    assert {kv["prefill_instance"] for kv in kvs} == {p["id"]}
    h = cl.health()
    assert cl.inst(cl.d_other.pid, h)["paired_with"] == [] and other["id"] not in \
        cl.inst(cl.p[0].pid, h)["paired_with"]
    wp, wo = (model_fingerprint(load_model(m)[0], 256)["weights"][:12] for m in (cl.model_dir,
                                                                               cl.other))
    for a, wa, b, wb in ((p["id"], wp, other["id"], wo), (other["id"], wo, p["id"], wp)):
        assert (f"model fingerprint mismatch, pairing refused: weights: {wa}… ({a}) vs {wb}… "
                f"({b})") in h["errors"]

def test_two_p_two_d_every_p_and_every_d_serve(cl):
    cl.p.append(cl.spawn("prefill"))
    cl.wait(lambda h: cl.inst(cl.p[1].pid, h) is not None
            and len(cl.inst(cl.p[1].pid, h)["paired_with"]) == 2, 60, "second P paired")
    kvs = run(cl, 100)
    assert sorted({kv["prefill_instance"] for kv in kvs}) == sorted(cl.inst(p.pid)["id"]
                                                                    for p in cl.p)
    assert sorted({kv["decode_instance"] for kv in kvs}) == sorted(cl.inst(d.pid)["id"]
                                                                   for d in cl.d)
    def settled(h):
        return all(i["free_blocks"] == i["num_blocks"] and i["num_running"] == 0
                   for i in h["instances"])
    cl.wait(settled, 5, "every block back", fresh=True)
