"""``python -m kvflow.serve``: router (FastAPI, OpenAI ``/v1/completions``) + prefill (P) and
decode (D) instances over a ZMQ control plane, KV moved by :mod:`kvflow.transfer`.

Modules: ``__main__`` (CLI), ``router`` (HTTP), ``control`` (ZMQ control plane, pairing,
liveness), ``instance`` (start-up and event loop shared by instances), ``prefill`` (P),
``decode`` (D and colocated), ``procs`` (child processes), ``metrics`` (Prometheus),
``api`` (request/response shapes).
"""
