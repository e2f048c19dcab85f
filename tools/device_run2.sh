#!/usr/bin/env bash
# H200 run: install, GPU tests (large shapes), kernel probe (correctness + GB/s vs same-run ceiling).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# The image's numba-cuda predates numpy 2.5 (np.row_stack removed); alias it for this run only.
echo 'import numpy as _np; _np.row_stack = getattr(_np, "row_stack", _np.vstack)' > /tmp/site/sitecustomize.py
export KVFLOW_COMMIT=${KVFLOW_COMMIT:-unknown}
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || tail -5 $OUT/install.log
echo commit $KVFLOW_COMMIT; python3 -c "import kvflow.kernels as k; print(k.available_backends())"
KVFLOW_TEST_SCALE=large timeout 200 python3 -m pytest -q -x tests/test_ops.py tests/test_triton_backend.py tests/test_numba_cuda.py tests/test_signal_channel.py tests/test_engine.py 2>&1 | tee $OUT/pytest.log | tail -8
timeout 330 python3 tools/gpu_probe.py --json $OUT/probe.json 2>&1 | tee $OUT/probe.log | tail -70
