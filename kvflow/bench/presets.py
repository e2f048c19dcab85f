"""Presets of the sweeping studies: ``--quick`` (CI, a 2-core CPU, < 60 s) and ``--full``
(one H200, minutes).

A preset is a plain dict of argparse defaults; flags given on the command line win over it. The
default geometry is :data:`kvflow.bench.cases.LLAMA3_8B`, bf16.
"""

from __future__ import annotations

from typing import Any

# 16 tokens to 64K tokens in powers of two (the sweep).
FULL_TOKENS = [16 << i for i in range(13)]

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "kernels": {
        "quick": {
            "tokens": [64, 256], "ops": ["gather", "scatter", "copy"],
            "layouts": ["NHD", "MLA"], "dtypes": ["bfloat16"], "num_blocks": 24,
            "warmup": 1, "reps": 5, "max_ctas": [None], "contention": False,
        },
        "full": {
            "tokens": FULL_TOKENS, "ops": ["gather", "scatter", "copy"],
            "layouts": ["NHD", "HND", "MLA"], "dtypes": ["bfloat16", "float8_e4m3fn"],
            "num_blocks": 4096, "warmup": 3, "reps": 30, "max_ctas": [None, 32],
            "contention": True,
        },
    },
    "calls": {
        "quick": {"calls": 300, "repeats": 3, "warmup": 20, "tokens": 32, "dtype": "bfloat16"},
        "full": {"calls": 2000, "repeats": 5, "warmup": 50, "tokens": 32, "dtype": "bfloat16"},
    },
    "reblock": {
        "quick": {"tokens": 256, "reps": 5, "batches": 2, "warmup": 1},
        "full": {"tokens": 4096, "reps": 30, "batches": 7, "warmup": 5},
    },
    "contention": {
        "quick": {"tokens": [2048], "max_ctas": [8, 32], "reps": 5, "prefill_tokens": 1024},
        "full": {"tokens": [16384], "max_ctas": [4, 8, 16, 32, 64, 132, None], "reps": 20,
                 "prefill_tokens": 4096},
    },
    "transfer": {
        "quick": {"tokens": [64, 256], "connectors": ["ipc-pull", "ipc-push", "tcp"],
                  "warmup": 1, "reps": 5, "num_blocks": 16},
        "full": {"tokens": [256, 1024, 4096, 16384, 65536],
                 "connectors": ["ipc-pull", "ipc-push", "tcp"], "warmup": 3, "reps": 30,
                 "num_blocks": 2048},
    },
    "serve": {
        "quick": {"num_requests": 8, "rate": 8.0, "prompt_len": "16:48", "output_len": "4:8",
                  "concurrency": 4},
        "full": {"num_requests": 200, "rate": 4.0, "prompt_len": "256:2048",
                 "output_len": "32:256", "concurrency": 64},
    },
}


def preset(command: str, name: str | None) -> dict[str, Any]:
    """Defaults of ``command`` for preset ``name`` ("quick" or "full"; None means "quick").

    Raises
    ------
    ValueError
        Naming the command or preset that does not exist.
    """
    if command not in PRESETS:
        raise ValueError(f"command={command!r} has no presets; known: {sorted(PRESETS)}")
    name = name or "quick"
    if name not in PRESETS[command]:
        raise ValueError(f"preset={name!r} is unknown for {command}; known: {sorted(PRESETS[command])}")
    return dict(PRESETS[command][name])


def reps_for(payload_bytes: int, reps: int) -> int:
    """Repetitions for one case: ``reps`` up to 1 GiB of payload, then fewer (at least 10) so
    the full sweep's 64K-token cases (8 GiB each at Llama-3-8B geometry) stay in budget."""
    if payload_bytes <= 1 << 30:
        return reps
    return max(10, reps * (1 << 30) // payload_bytes)
