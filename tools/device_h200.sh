#!/usr/bin/env bash
# One H200 (run tool, carry .whl): GPU tests, kernel probe, kernels --full sweep, layerwise study.
# Usage: KVFLOW_COMMIT=$(git rev-parse --short=12 HEAD) bash tools/device_h200.sh
source "$(dirname "$0")/device_env.sh"
timeout 170 python3 -m pytest -q tests/test_ops.py tests/test_triton_backend.py tests/test_numba_cuda.py \
    tests/test_signal_channel.py tests/test_engine.py -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | tail -6
timeout 250 python3 tools/gpu_probe.py --json $OUT/probe.json > $OUT/probe.log 2>&1
grep -E "correctness|ceiling|default|stream|max_ctas=8 |per-layer" $OUT/probe.log | head -60
timeout 300 python3 -m kvflow.bench kernels --full --no-progress --out-dir $OUT > $OUT/kernels_full.log 2>&1
tail -25 $OUT/kernels_full.log
timeout 150 python3 bench/layerwise_gpu.py > $OUT/layerwise.log 2>&1; tail -40 $OUT/layerwise.log
