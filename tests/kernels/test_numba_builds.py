"""The numba CPU kernels' serial and parallel builds stay two builds across processes (their
on-disk cache entries must not be shared: kvflow.kernels.numba.pointers.serial_and_parallel)."""

import json
import os
import subprocess
import sys

import pytest

# In a fresh process: run one build of a kernel (serial or parallel) on real arrays, then say
# whether numba's thread pool was started (only a parallel build starts it).
_CHILD = r"""
import json, sys
import numba, numpy as np
from kvflow.kernels.numba import cpu, reblock
which, kernel = sys.argv[1], sys.argv[2]
mod = cpu if kernel == "copy" else reblock
fn = getattr(mod, "_" + which)
if kernel == "copy":
    src, dst = np.arange(64, dtype=np.uint64), np.zeros(64, dtype=np.uint64)
    ptrs = lambda a: np.array([a.ctypes.data], dtype=np.int64)
    ids = np.array([1, 0], dtype=np.int64)
    fn(ptrs(src), ptrs(dst), ids, ids, 0, 0, 2, 2, 2, 4, 8, np.zeros(0, np.int64), 0, 32, 32)
    assert dst[:8].tolist() == src[:8].tolist()
else:
    # the reblock kernel: compiled through its public wrapper's first call
    import torch
    from kvflow.cache import PagedKVCache
    from kvflow.kernels import copy_sequence
    from kvflow.layout import KVCacheSpec
    a = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4,
                                 dtype=torch.float32), 4)
    b = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=2,
                                 dtype=torch.float32), 8)
    mod.PARALLEL_MIN_BYTES = 0 if which == "parallel" else 1 << 60
    copy_sequence(a, b, torch.tensor([0, 1]), torch.tensor([0, 1, 2, 3]), backend="numba")
try:
    numba.threading_layer()
    pool = True
except ValueError:
    pool = False
print(json.dumps({"pool": pool}))
"""


def _run(which: str, kernel: str, cache_dir) -> bool:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", _CHILD, which, kernel], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["pool"]


@pytest.mark.parametrize("kernel", ["copy", "reblock"])
def test_parallel_build_is_not_the_cached_serial_one(kernel, tmp_path):
    # The serial build compiles and is cached first; a later process's parallel build must
    # still be parallel (before the fix it loaded the serial entry: no thread pool).
    assert _run("serial", kernel, tmp_path) is False
    assert _run("parallel", kernel, tmp_path) is True
    assert _run("serial", kernel, tmp_path) is False  # and the serial one stays serial
