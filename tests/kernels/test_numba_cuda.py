"""The ``numba_cuda`` backend matches the torch reference byte for byte.

On a CUDA host with numba-cuda the checks run in this process on ``cuda`` tensors. Without a
GPU they run in numba's CUDA simulator on CPU tensors, in a subprocess, because
``NUMBA_ENABLE_CUDASIM=1`` must be set before numba.cuda is first imported (and the other test
files import it without the simulator). The simulator runs every CUDA thread as a Python
thread, so shapes stay tiny; it checks the indexing, skipping and grid-stride logic, not the
16-byte intrinsic (replaced there by ``ctypes.memmove``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow import KVCacheSpec, staging_buffer
from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks

from tests.conftest import assert_bytes_equal, backends_for, cache_bytes, random_bytes_, random_cache

ROOT = Path(__file__).resolve().parents[2]
CASES = [  # (layout, dtype, heads, head_dim, block_size): word widths 16, 1, 4, 2, 16
    ("NHD", torch.bfloat16, 2, 8, 4),
    ("HND", torch.float8_e4m3fn, 3, 5, 3),
    ("MLA", torch.float32, 1, 5, 3),
    ("NHD", torch.float16, 1, 3, 3),
    ("BM_NHD", torch.bfloat16, 2, 8, 4),  # block-major: blocks block_stride_bytes apart
]


def check_all(device: str) -> int:
    """Every op x case x layer range x max_ctas, and copy in both directions, against torch.
    Returns the number of comparisons made (raises AssertionError on the first mismatch)."""
    done = 0
    for layout, dtype, heads, dim, bs in CASES:
        spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=dim, block_size=bs,
                           dtype=dtype, layout=layout)
        src = random_cache(spec, 6, device, seed=1)
        ids = torch.tensor([5, -1, 0, 7, 3], device=device)        # 7: outside, skipped
        dst_ids = torch.tensor([2, 4, -1, 0, 5], dtype=torch.int32, device=device)
        for layers, max_ctas in (((1, 3), None), (None, 1)):
            what = f"{layout} {dtype} layers={layers} max_ctas={max_ctas}"
            ref = random_bytes_(staging_buffer(spec, 5, layers, device), 2)
            out = ref.clone()
            gather_blocks(src, ids, ref, layers, backend="torch", validate=False)
            gather_blocks(src, ids, out, layers, backend="numba_cuda", max_ctas=max_ctas,
                          validate=False)
            assert_bytes_equal(out, ref, f"gather {what}")
            a, b = random_cache(spec, 6, device, seed=3), random_cache(spec, 6, device, seed=3)
            scatter_blocks(out, a, dst_ids, layers, backend="torch")
            scatter_blocks(out, b, dst_ids, layers, backend="numba_cuda", max_ctas=max_ctas)
            assert_bytes_equal(cache_bytes(b), cache_bytes(a), f"scatter {what}")
            copy_blocks(src, a, ids, dst_ids, layers, backend="torch", validate=False)
            for direction in ("pull", "push"):
                c = random_cache(spec, 6, device, seed=3)
                scatter_blocks(out, c, dst_ids, layers, backend="torch")
                copy_blocks(src, c, ids, dst_ids, layers, backend="numba_cuda",
                            max_ctas=max_ctas, validate=False, direction=direction)
                assert_bytes_equal(cache_bytes(c), cache_bytes(a), f"copy {direction} {what}")
            done += 4
    if device != "cpu":
        torch.cuda.synchronize()
    return done


@pytest.mark.skipif("numba_cuda" not in backends_for("cuda"),
                    reason="needs a CUDA GPU and numba-cuda")
def test_numba_cuda_on_gpu_matches_reference():
    assert check_all("cuda") == 4 * len(CASES) * 2


def test_numba_cuda_in_simulator_matches_reference():
    if "numba_cuda" in backends_for("cuda"):
        pytest.skip("real GPU present: the GPU test covers this")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    code = "from tests.kernels.test_numba_cuda import check_all; print('checked', check_all('cpu'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["checked", str(4 * len(CASES) * 2)], proc.stdout


def test_simulator_is_the_only_cpu_path():
    """Outside the simulator numba_cuda never claims CPU tensors (they would be read as
    device addresses)."""
    from kvflow.kernels.registry import get_backend
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("running inside the simulator")
    with pytest.raises((ValueError, RuntimeError), match=r"^backend='numba_cuda' "):
        get_backend("numba_cuda", torch.device("cpu"))
