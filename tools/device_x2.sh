#!/usr/bin/env bash
# Two H200s (run tool, kind nvidia-h200-x2, carry .whl): peer/IPC tests, then bench/ipc_gpu.py.
# Usage: KVFLOW_COMMIT=$(git rev-parse --short=12 HEAD) bash tools/device_x2.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi topo -m | head -4
timeout 200 python3 -m pytest -q tests/test_cuda_ipc.py tests/test_triton_backend.py -k "cuda_ipc or two_gpus" \
    -p no:cacheprovider 2>&1 | tee $OUT/pytest_x2.log | tail -8
timeout 330 python3 bench/ipc_gpu.py > $OUT/ipc.log 2>&1; tail -60 $OUT/ipc.log
cp bench/results/ipc_gpu-*.json $OUT/ 2>/dev/null
