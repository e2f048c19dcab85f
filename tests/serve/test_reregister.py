"""An instance asked to register again registers once, however many asks were queued while its
loop was busy (a CI run on loaded cores showed seven Registers from one P after one stop)."""

from __future__ import annotations

import types

from kvflow.serve.instance.base import Instance
from kvflow.serve.protocol import Registered, Reregister


def _instance():
    inst = types.SimpleNamespace(instance_id="p-1", registered=True, _reregistered_at=0.0, sent=0)
    inst.register = lambda: setattr(inst, "sent", inst.sent + 1)
    return inst


def test_queued_asks_give_one_register_and_the_answer_allows_the_next():
    inst, ask = _instance(), Reregister(reason="declared dead after missed heartbeats")
    for _ in range(7):
        Instance.on_reregister(inst, ask, [], b"")
    assert (inst.sent, inst.registered) == (1, False)
    Instance.on_registered(inst, Registered(ok=True), [], b"")
    assert inst.registered
    Instance.on_reregister(inst, ask, [], b"")
    assert inst.sent == 2


def test_an_unanswered_register_is_sent_again_after_5_s():
    inst, ask = _instance(), Reregister(reason="")
    Instance.on_reregister(inst, ask, [], b"")
    inst._reregistered_at -= 5.0
    Instance.on_reregister(inst, ask, [], b"")
    assert inst.sent == 2
