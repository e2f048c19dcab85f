#!/usr/bin/env bash
# Two H200s (run tool, kind nvidia-h200-x2, carry .whl).
# Usage: KVFLOW_COMMIT=$(git rev-parse --short=12 HEAD) bash tools/device_x2.sh [serve|kernels]
#   serve:   GPU tests (one and two GPUs), then bench/ipc_gpu.py --serve-only (served modes)
#   kernels: tools/gpu_probe.py (all layouts), kernels --full sweep, bench/ipc_gpu.py --no-serve
source "$(dirname "$0")/device_env.sh"
nvidia-smi topo -m | head -3
if [ "${1:-serve}" = serve ]; then
  timeout 300 python3 -m pytest -q tests/test_cuda_ipc.py tests/test_triton_backend.py tests/test_ops.py \
      tests/test_numba_cuda.py tests/test_signal_channel.py tests/test_engine.py -p no:cacheprovider \
      2>&1 | tee $OUT/pytest_x2.log | tail -8
  timeout 260 python3 bench/ipc_gpu.py --serve-only --out $OUT/ipc_gpu-served.json > $OUT/ipc_served.log 2>&1
  tail -30 $OUT/ipc_served.log
else
  timeout 200 python3 tools/gpu_probe.py --json $OUT/probe.json > $OUT/probe.log 2>&1
  grep -E "correctness|FAIL|ceiling|default|max_ctas=8 " $OUT/probe.log | head -70
  timeout 150 python3 -m kvflow.bench kernels --full --no-progress --out-dir $OUT > $OUT/kernels_full.log 2>&1
  tail -5 $OUT/kernels_full.log
  timeout 220 python3 bench/ipc_gpu.py --no-serve --out $OUT/ipc_gpu-kernels.json > $OUT/ipc_kernels.log 2>&1
  grep -vE "^\s*$" $OUT/ipc_kernels.log | tail -45
fi
