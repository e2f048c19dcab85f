"""kvflow inside other serving engines (``kvflow.integrations.vllm``: a vLLM KV connector)."""
