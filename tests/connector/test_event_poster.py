"""The thread that posts a layer group's NIXL WRITE once the GPU work it reads is done
(:mod:`kvflow.connector.transport.event_poster`), with stand-in events: each post runs after
its event's ``synchronize`` returned, in submission order, off the submitting thread; the first
error reaches :meth:`drain` and the posts after it are skipped."""

from __future__ import annotations

import threading

from kvflow.connector.transport.event_poster import EventPoster


class Gate:
    """An event that is done once the test opens it."""

    def __init__(self, log: list, name: str) -> None:
        self.opened, self.log, self.name = threading.Event(), log, name

    def synchronize(self) -> None:
        assert self.opened.wait(10.0)
        self.log.append(f"{self.name} done")


def test_posts_run_after_their_event_in_order_off_the_caller_thread():
    log: list = []
    poster = EventPoster()
    try:
        gates = [Gate(log, f"e{i}") for i in range(3)]
        threads = []

        def post(i):
            def run():
                threads.append(threading.get_ident())
                log.append(f"post {i}")
                return f"handle {i}"
            return run
        for i, g in enumerate(gates):
            poster.submit(g, post(i))
        poster.submit(None, lambda: None)  # no event, no handle
        assert log == []  # nothing posted while the GPU work is not done
        for g in reversed(gates):
            g.opened.set()
        assert poster.drain() == (["handle 0", "handle 1", "handle 2"], None)
        assert log == ["e0 done", "post 0", "e1 done", "post 1", "e2 done", "post 2"]
        assert threading.get_ident() not in threads
        assert poster.drain() == ([], None)  # results are handed out once
    finally:
        poster.close()


def test_the_first_error_reaches_drain_and_later_posts_are_skipped():
    ran: list = []
    poster = EventPoster()
    try:
        poster.submit(None, lambda: "h0")
        poster.submit(None, lambda: 1 / 0)
        poster.submit(None, lambda: ran.append("late") or "h2")
        done, error = poster.drain()
        assert done == ["h0"] and ran == []
        assert isinstance(error, ZeroDivisionError)
        poster.submit(None, lambda: "h3")  # the next request posts again
        assert poster.drain() == (["h3"], None)
    finally:
        poster.close()
