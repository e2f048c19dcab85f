"""Bad flags and ``--help`` of ``python -m kvflow.serve`` are answered before torch and numba
import (minutes on a busy host): each case runs ``main`` in a fresh interpreter and checks the
one line, the exit status and that neither module was loaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = ("import json, sys\n"
          "from kvflow.serve.__main__ import main\n"
          "try:\n"
          "    code = main(sys.argv[1:])\n"
          "except SystemExit as exc:\n"
          "    code = exc.code\n"
          "sys.stdout.flush()\n"
          "print(json.dumps({'code': code, 'heavy': sorted(m for m in ('torch', 'numba', "
          "'triton') if m in sys.modules)}))\n")


def _run(*argv: str) -> tuple[dict, str, str]:
    p = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True,
                       timeout=60)
    *out, last = p.stdout.splitlines()
    return json.loads(last), "\n".join(out), p.stderr.strip()


@pytest.mark.parametrize("argv, line", [
    (["--model", "kvflow-tinny"],
     "--model 'kvflow-tinny' is neither a built-in model (kvflow-tiny, kvflow-llama-32l) nor a "
     "directory; pass one of those names or the path of a local Hugging Face Llama/Qwen2 "
     "checkpoint"),
    (["--role", "decode"],
     "--role decode needs --router-url tcp://HOST:PORT (the router's control address)"),
    (["--max-model-len", "100000"],
     "--max-model-len 100000 exceeds the model's max_position_embeddings=4096 (kvflow-tiny); "
     "use at most 4096"),
    (["--model", "kvflow-llama-32l", "--max-model-len", "40000"],
     "--max-model-len 40000 exceeds the model's max_position_embeddings=32768 "
     "(kvflow-llama-32l); use at most 32768"),
    (["--backend", "nonsense"], "--backend nonsense is unknown; use auto or one of copy_engine, "
                                "native, numba, numba_cuda, torch, triton, xpu"),
])
def test_bad_flag_is_refused_before_torch(argv, line):
    got, _, err = _run(*argv)
    assert got == {"code": 1, "heavy": []}
    assert err == "kvflow.serve: error: " + line


def test_help_comes_before_torch():
    got, out, err = _run("--help")
    assert got == {"code": 0, "heavy": []} and err == ""
    assert out.startswith("usage: ") and "--max-model-len" in out and "--router-url" in out


def test_backend_names_are_the_registry_s():
    from kvflow.kernels.registry import backend_names
    from kvflow.serve.launch.checks import BACKEND_NAMES

    assert list(BACKEND_NAMES) == backend_names()
