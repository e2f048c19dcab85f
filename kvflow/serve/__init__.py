"""``python -m kvflow.serve``: router (FastAPI, OpenAI ``/v1/completions``) + prefill (P) and
decode (D) instances over a ZMQ control plane, KV moved by a :mod:`kvflow.connector`.

Modules: ``__main__`` (CLI), ``router`` (HTTP), ``control`` (ZMQ control plane, pairing,
liveness), ``loop`` (the event loop), ``instance`` (settings, start-up and registration),
``prefill`` (P), ``decode`` (D), ``sequences`` (live requests and the decode loop of D and
colocated), ``lent`` (D's blocks a P may still write), ``colocated`` (prefill + decode in one),
``pairing``, ``sampling``, ``procs`` (child processes), ``metrics`` (Prometheus), ``api``
(request/response shapes).
"""
