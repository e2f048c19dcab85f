#!/usr/bin/env bash
# 2xH200: peer/IPC tests, then the IPC benchmark (issue 6).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
echo 'import numpy as _np; _np.row_stack = getattr(_np, "row_stack", _np.vstack)' > /tmp/site/sitecustomize.py
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || tail -5 $OUT/install.log
echo commit $KVFLOW_COMMIT; nvidia-smi topo -m | head -4
timeout 200 python3 -m pytest -q tests/test_cuda_ipc.py tests/test_triton_backend.py -k "cuda_ipc or two_gpus" -p no:cacheprovider 2>&1 | tee $OUT/pytest_x2.log | tail -8
timeout 330 python3 bench/ipc_gpu.py > $OUT/ipc.log 2>&1; tail -60 $OUT/ipc.log
cp bench/results/ipc_gpu-*.json $OUT/ 2>/dev/null; ls $OUT
