"""Serving instances: P (:mod:`.prefill`), D (:mod:`.decode`, :mod:`.arrivals`), colocated, on
one event loop (:mod:`.loop`, :mod:`.base`), with live sequences, sampling and the heartbeat."""
