#!/usr/bin/env bash
# H200: GPU tests at default scale, then the kernel probe with queue-ahead timing.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
echo 'import numpy as _np; _np.row_stack = getattr(_np, "row_stack", _np.vstack)' > /tmp/site/sitecustomize.py
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || tail -5 $OUT/install.log
echo commit $KVFLOW_COMMIT
timeout 170 python3 -m pytest -q tests/test_ops.py tests/test_triton_backend.py tests/test_numba_cuda.py tests/test_signal_channel.py tests/test_engine.py -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | tail -6
timeout 330 python3 tools/gpu_probe.py --json $OUT/probe.json 2>&1 > $OUT/probe.log; grep -E "correctness|ceiling|default|stream|max_ctas=8 |per-layer" $OUT/probe.log | head -80
