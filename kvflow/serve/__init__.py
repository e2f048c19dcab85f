"""``python -m kvflow.serve``: router (FastAPI, OpenAI ``/v1/completions``) + prefill (P) and
decode (D) instances over a ZMQ control plane, KV moved by a :mod:`kvflow.connector`.

Rooms by role: :mod:`~kvflow.serve.launch` (flags, checks, start-up, child processes, output),
:mod:`~kvflow.serve.router` (HTTP app, control plane, placement, liveness, metrics),
:mod:`~kvflow.serve.instance` (P, D, colocated: event loop, sequences, sampling, heartbeat);
shared by the router and the instances: ``advertise`` (addresses peers dial) and ``timings``
(per-hop stamps). docs/design.md draws one request's path through them.
"""
