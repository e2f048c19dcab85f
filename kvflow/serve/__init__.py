"""``python -m kvflow.serve``: router (FastAPI, OpenAI ``/v1/completions``) + prefill (P) and
decode (D) instances over a ZMQ control plane, KV moved by a :mod:`kvflow.connector`.

Modules: ``__main__`` (CLI entry), ``config`` (:class:`ServeConfig`: every flag, the parser
generated from it), ``checks`` and ``startup`` (one-line start-up errors), ``server`` (the router
process and its child instances), ``procs`` (child processes), ``output`` (console lines);
the router: ``router`` (request orchestration), ``app`` (FastAPI app, SSE), ``errors``
(HTTP error wording), ``api`` (request/response shapes), ``control`` (ZMQ control plane,
pairing, liveness), ``placement`` (which P and D), ``metrics`` (Prometheus); the instances:
``loop`` (the event loop), ``instance`` (start-up and registration), ``prefill`` (P),
``decode`` (D), ``arrivals`` (D's KV arrivals), ``sequences`` (live requests and the decode
loop of D and colocated), ``lent`` (D's blocks a P may still write), ``colocated`` (prefill +
decode in one), ``pairing``, ``sampling``, ``fingerprint``, ``budget``, ``faults`` (test-only
fault injection).
"""
