"""``python -m kvflow.serve``: router (FastAPI, OpenAI ``/v1/completions``) + prefill (P) and
decode (D) instances over a ZMQ control plane, KV moved by a :mod:`kvflow.connector`:
:mod:`~kvflow.serve.launch`, :mod:`~kvflow.serve.router`, :mod:`~kvflow.serve.instance`, and
``advertise`` and ``timings``, shared. docs/design.md, "Layers"."""
