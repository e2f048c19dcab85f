"""``python -m kvflow.serve``: router + P and D instances over a ZMQ control plane, KV moved by a
:mod:`kvflow.connector` (docs/design.md, "Layers")."""
