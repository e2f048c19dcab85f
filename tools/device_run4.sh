#!/usr/bin/env bash
# H200: kernel probe (queue-ahead timing, streaming variant), then the kernels --full sweep.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
echo 'import numpy as _np; _np.row_stack = getattr(_np, "row_stack", _np.vstack)' > /tmp/site/sitecustomize.py
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || tail -5 $OUT/install.log
echo commit $KVFLOW_COMMIT
timeout 250 python3 tools/gpu_probe.py --skip-correctness --json $OUT/probe.json > $OUT/probe.log 2>&1; grep -E "ceiling|default|stream|ctas/SM=16|max_ctas=8 |per-layer" $OUT/probe.log | head -60; tail -3 $OUT/probe.log
timeout 300 python3 -m kvflow.bench kernels --full --no-progress --out-dir $OUT > $OUT/kernels_full.log 2>&1; tail -25 $OUT/kernels_full.log
