#!/usr/bin/env bash
# First H200 run: environment, install, kernel probe, GPU tests, layerwise study.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
(time python3 -m pip install -q --no-deps --no-build-isolation -e . ) 2>&1 | tail -5
python3 -c "import kvflow.kernels as k; print(k.available_backends())"
timeout 200 python3 tools/gpu_probe.py --quick --json $OUT/probe.json 2>&1 | tee $OUT/probe.log | tail -60
timeout 150 python3 -m pytest -x -q tests/test_ops.py tests/test_triton_backend.py tests/test_signal_channel.py tests/test_numba_cuda.py 2>&1 | tail -15
timeout 150 python3 bench/layerwise_gpu.py 2>&1 | tee $OUT/layerwise.log | tail -40
cp bench/results/layerwise_gpu.json $OUT/ 2>/dev/null
