"""kvflow as a vLLM KV connector (vLLM >= 0.32, ``pip install -e ".[vllm]"``).

``KvflowConnector`` (:mod:`.connector`) imports vLLM; :mod:`.transfer` and :mod:`.messages`
(the pull over ZMQ) and :mod:`.proxy` (the OpenAI front) do not. See docs/tutorials/vllm.md.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("KvflowConnector", "KvflowMeta"):
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KvflowConnector", "KvflowMeta"]
