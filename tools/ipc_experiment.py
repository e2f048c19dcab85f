"""Which order/direction makes a CUDA-IPC-mapped cache readable by the kvflow copy kernel in
the importing process? Run on 2 GPUs: P (exporter) on GPU 1; D variants in fresh processes."""
import os, subprocess, sys, torch

P = r'''
import sys, torch
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.transfer.cuda_ipc import export_cache, publish_export
spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
c = PagedKVCache(spec, 64, device="cuda:0"); c.buffer.copy_(torch.arange(c.buffer.numel(), device="cuda:0").to(torch.uint8)); torch.cuda.synchronize()
print(publish_export(export_cache(c)), flush=True); sys.stdin.readline()
'''
D = r'''
import sys, torch
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.kernels import copy_blocks
from kvflow.transfer.cuda_ipc import enable_peer_access, import_cache, read_export, ordinal_of_uuid
spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
order, direction, backend = sys.argv[1], sys.argv[2], sys.argv[3]
exp = read_export(sys.argv[4])
d = PagedKVCache(spec, 64, device="cuda:0")
if order == "enable_first":
    enable_peer_access(torch.device("cuda", 0), torch.device("cuda", ordinal_of_uuid(exp.uuid)))
peer = import_cache(exp, spec, 64)
if order == "import_first":
    enable_peer_access(d.device, peer.device)
src, dst = torch.tensor([5, 63, 0]), torch.tensor([1, 2, 40])
if direction == "push":
    with torch.cuda.device(peer.device):
        copy_blocks(peer, d, src, dst, backend=backend, direction="push")
else:
    copy_blocks(peer, d, src, dst, backend=backend)
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
ok = all(torch.equal(a[dst.cuda()].cpu(), b[src.to(b.device)].cpu()) for a, b in zip(d.tensors(), peer.tensors()))
print("RESULT", order, direction, backend, "OK" if ok else "MISMATCH", flush=True)
'''
p = subprocess.Popen([sys.executable, "-c", P], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                     env=dict(os.environ, CUDA_VISIBLE_DEVICES="1"))
name = p.stdout.readline().strip()
for args in [("import_first", "pull", "triton"), ("enable_first", "pull", "triton"),
             ("import_first", "push", "triton"), ("import_first", "pull", "torch"),
             ("enable_first", "push", "triton")]:
    r = subprocess.run([sys.executable, "-c", D, *args, name], capture_output=True, text=True,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1"), timeout=120)
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
    print(line[0] if line else f"RESULT {' '.join(args)} FAILED: {(r.stderr.strip().splitlines() or ['?'])[-1][:160]}", flush=True)
p.stdin.close(); p.wait(30)
