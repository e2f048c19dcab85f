"""Compile the re-blocking kernel for sm_90 without a GPU (Triton's own compiler and ptxas) and
print, per case, the widest global loads/stores, the conversions, the float32 divisions and
reciprocals, the fused multiply-adds and the flush-to-zero ops (JSON lines). Run in a
subprocess by tests/kernels/test_reblock_triton.py: the test process runs Triton's interpreter."""

from __future__ import annotations

import json
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvflow import KVCacheSpec  # noqa: E402
from kvflow.kernels.reblock import make_mapping  # noqa: E402
from kvflow.kernels.contract import Job, Operand  # noqa: E402
from kvflow.kernels.triton import reblock_launch as rl  # noqa: E402
from kvflow.kernels.triton.reblock import _reblock  # noqa: E402

E4 = torch.float8_e4m3fn
BASE = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                   dtype=torch.bfloat16, layout="NHD")
B64 = BASE.with_(block_size=64)
CASES = {"bs16->64": (BASE, B64), "bs64->16": (B64, BASE),
         "nhd->hnd": (B64, B64.with_(layout="HND")), "bf16->fp8": (B64, B64.with_(dtype=E4)),
         "bf16->fp8 block_head": (B64, B64.with_(dtype=E4, scales="block_head")),
         "fp8 block_head->bf16": (B64.with_(dtype=E4, scales="block_head"), BASE)}

for name, (s, d) in CASES.items():
    job = Job(make_mapping(s, d), Operand(s, object(), None, None, 10, 0, None),
              Operand(d, object(), None, None, 10, 0, None), 64, 4096)
    plan = rl.ReblockPlan(job, torch.device("cuda", 0), 16, 16, True, True, check=True,
                          dup=True, max_ctas=None)
    sig = {a: "i64" for a in rl._RUNTIME} | {k: "constexpr" for k in plan.consts}
    k = triton.compile(ASTSource(fn=_reblock, signature=sig, constexprs=dict(plan.consts)),
                       target=GPUTarget("cuda", 90, 32), options=plan.options)
    ptx = k.asm["ptx"]
    print(json.dumps({"case": name, "ld": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
                      "st": sorted(set(re.findall(r"st\.global[.\w]*", ptx))),
                      "cvt": sorted(set(re.findall(r"cvt\.rn[.\w]*", ptx))),
                      "div": sorted(set(re.findall(r"(?:div|rcp)\.[.\w]*f32", ptx))),
                      "fma": sorted(set(re.findall(r"fma\.[.\w]*f(?:16|32)[.\w]*", ptx))),
                      "ftz": sorted(set(re.findall(r"\w+\.[.\w]*ftz[.\w]*", ptx)))}))
