#!/usr/bin/env bash
# Sourced by the device scripts: carried wheels, the numba-cuda/numpy alias, kvflow installed.
# (The image's numba-cuda predates numpy 2.5, which removed np.row_stack; the alias is set for
# the device run only, never in kvflow itself.)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVFLOW_COMMIT=${KVFLOW_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
echo 'import numpy as _np; _np.row_stack = getattr(_np, "row_stack", _np.vstack)' > /tmp/site/sitecustomize.py
python3 -m pip install -q --no-deps --no-build-isolation -e . > "${OUT:-/tmp}/install.log" 2>&1 || tail -5 "${OUT:-/tmp}/install.log"
echo "commit $KVFLOW_COMMIT"
