"""Can a kernel on GPU A read and write a cache that another process exported from GPU B?

Run on 2 GPUs. The exporter X sees only physical GPU 1 and fills its cache with a pattern. Each
importer Y (a fresh process) opens X's handle with ``import_cache(map_on=...)`` and runs the
triton copy kernel: "pull" copies X's blocks into Y's own cache, "push" writes Y's blocks into
X's cache (X checks them afterwards). ``map_on=owner`` is how torch maps a handle by default
(into the owner's context only); ``map_on=mine`` maps it into the importer's own GPU (peer
access enabled lazily: cudaIpcMemLazyEnablePeerAccess).
"""
import os
import subprocess
import sys

X = r'''
import sys, torch
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.transfer.cuda_ipc import export_cache, publish_export
spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
c = PagedKVCache(spec, 64, device="cuda:0")
c.buffer.copy_(torch.arange(c.buffer.numel(), device="cuda:0").to(torch.uint8)); torch.cuda.synchronize()
print(publish_export(export_cache(c)), flush=True)
for line in sys.stdin:  # "check <tag> <dst ids>": were Y's blocks (pattern 200 + j) pushed there?
    tag, ids = line.split()[1], [int(i) for i in line.split()[2].split(",")]
    torch.cuda.synchronize()
    ok = all(bool((t[ids].view(torch.uint8) == 200 + j).all()) for j, t in enumerate(c.tensors()))
    print("RESULT", tag, "push-into-exporter", "OK" if ok else "MISMATCH", flush=True)
'''
Y = r'''
import sys, torch
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.kernels import copy_blocks
from kvflow.transfer.cuda_ipc import import_cache, read_export, ordinal_of_uuid
spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
tag, mine, where, op, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
exp = read_export(name)
owner = ordinal_of_uuid(exp.uuid)
peer = import_cache(exp, spec, 64, map_on=None if where == "owner" else torch.device("cuda", mine))
d = PagedKVCache(spec, 64, device=f"cuda:{mine}")
for j, t in enumerate(d.tensors()):
    t.view(torch.uint8).fill_(200 + j)
torch.cuda.synchronize(mine)
src, dst = torch.tensor([5, 63, 0]), torch.tensor([1, 2, 40])
if op == "pull":  # the kernel runs on Y's GPU (dst side) in both cases
    copy_blocks(peer, d, src, dst, backend="triton", direction="pull")
else:
    copy_blocks(d, peer, dst, src, backend="triton", direction="push")
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
if op == "pull":
    full = torch.arange(exp.nbytes, device=f"cuda:{mine}").to(torch.uint8)
    ref = PagedKVCache(spec, 64, buffer=full)
    ok = all(torch.equal(a[dst.to(a.device)].view(torch.uint8), b[src.to(b.device)].view(torch.uint8))
             for a, b in zip(d.tensors(), ref.tensors()))  # bytes: bf16 patterns hold NaNs
    print("RESULT", tag, op, "OK" if ok else "MISMATCH", flush=True)
else:
    print("PUSHED", flush=True)
'''


def main() -> int:
    p = subprocess.Popen([sys.executable, "-c", X], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="1"))
    name = p.stdout.readline().strip()
    # (tag, importer's CUDA_VISIBLE_DEVICES, importer's own ordinal, map on, op)
    cases = [("mine01-pull", "0,1", 0, "mine", "pull"), ("mine01-push", "0,1", 0, "mine", "push"),
             ("mine10-pull", "1,0", 1, "mine", "pull"), ("mine10-push", "1,0", 1, "mine", "push"),
             ("owner01-pull", "0,1", 0, "owner", "pull")]
    for tag, cvd, mine, where, op in cases:
        r = subprocess.run([sys.executable, "-c", Y, tag, str(mine), where, op, name],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=cvd))
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("RESULT", "PUSHED"))]
        if not lines:
            err = (r.stderr.strip().splitlines() or ["?"])[-1][:200]
            print("RESULT", tag, op, "FAILED:", err, flush=True)
        elif lines[0].startswith("PUSHED"):
            p.stdin.write(f"check {tag} 5,63,0\n")
            p.stdin.flush()
            print(p.stdout.readline().strip(), flush=True)
        else:
            print(lines[0], flush=True)
    p.stdin.close()
    p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
