"""kvflow as a vLLM KV connector (vLLM >= 0.32, ``pip install -e ".[vllm]"``): only
``KvflowConnector`` (:mod:`.connector`) imports vLLM. docs/tutorials/vllm.md."""

__all__ = ["KvflowConnector", "KvflowMeta"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
