"""Device visibility of spawned workers (kvflow.devices) and the extension's build config."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from kvflow.devices import visible_devices, visibility_vars, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_worker_env_sets_the_variable_explicitly():
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert worker_env("cuda", 3, base) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3"}
    assert worker_env("xpu", [1, 2], base)["XPU_VISIBLE_DEVICES"] == "1,2"
    assert visibility_vars("cpu") == {"CUDA_VISIBLE_DEVICES": "", "XPU_VISIBLE_DEVICES": ""}
    with pytest.raises(ValueError, match=r"^device_kind must be one of \('cpu', 'cuda', 'xpu'\), got 'npu'$"):
        worker_env("npu", 0)
    with pytest.raises(ValueError, match=r"^device_index must be a non-negative int or a non-empty sequence "
                                         r"of them, got -1$"):
        worker_env("cuda", -1)
    with pytest.raises(ValueError, match=r"^device_index repeats a card: \[2, 2\]$"):
        worker_env("xpu", [2, 2])


def test_subprocess_child_sees_the_card():
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['XPU_VISIBLE_DEVICES'])"],
                         env=worker_env("xpu", 5), capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "5"


def _report(q):
    q.put((os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("XPU_VISIBLE_DEVICES")))


def test_spawned_process_sees_the_card_and_parent_env_is_restored():
    before = os.environ.get("XPU_VISIBLE_DEVICES")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with visible_devices("xpu", 2):
        p = ctx.Process(target=_report, args=(q,))
        p.start()
    assert os.environ.get("XPU_VISIBLE_DEVICES") == before
    assert q.get(timeout=60)[1] == "2"
    p.join(30)
    assert p.exitcode == 0


def _build_module():
    spec = importlib.util.spec_from_file_location("kvflow_xpu_build", os.path.join(ROOT, "xpu", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_config_without_sdk_is_host_only():
    sources, kwargs, variant = _build_module().extension_kwargs(env={}, root=ROOT)
    assert variant == "host backend (no KVFLOW_XPU_SDK)"
    assert sources == ["xpu/src/copy_runs_host.cc", "xpu/src/module.cc"]
    assert "define_macros" not in kwargs and "libraries" not in kwargs and kwargs["cxx_std"] == 17


def test_build_config_with_sdk_adds_xpu(tmp_path):
    (tmp_path / "include" / "xpu").mkdir(parents=True)
    (tmp_path / "include" / "xpu" / "runtime.h").write_text("")
    (tmp_path / "so").mkdir()
    (tmp_path / "so" / "libxpurt.so").write_text("")
    b = _build_module()
    sources, kwargs, variant = b.extension_kwargs(env={"KVFLOW_XPU_SDK": str(tmp_path)}, root=ROOT)
    assert variant == f"host + xpu backends (KVFLOW_XPU_SDK={tmp_path})"
    assert "xpu/src/xpu_runtime.cc" in sources
    assert kwargs["define_macros"] == [("KVFLOW_WITH_XPU", "1")] and kwargs["libraries"] == ["xpurt"]
    assert kwargs["library_dirs"] == [str(tmp_path / "so")] and str(tmp_path / "include") in kwargs["include_dirs"]
    (tmp_path / "so" / "libxpurt.so").unlink()
    with pytest.raises(RuntimeError, match=r"has no libxpurt.so under so/, lib/ or lib64/$"):
        b.extension_kwargs(env={"KVFLOW_XPU_SDK": str(tmp_path)}, root=ROOT)
