"""The cross-process variant of the ``ipc`` study (:mod:`.ipc`): P in a child process
(``python -m kvflow.bench ipc --p-child``, ``CUDA_VISIBLE_DEVICES`` = P's GPU only) allocates
its cache, fills the pattern and exports it over CUDA IPC; this process (D) opens the export by
UUID, maps it on P's GPU (``xproc_push``) and again on D's GPU (``xproc_pull``, when torch gives
a fresh mapping) and times the kvflow kernels against it (:func:`.ipc.run_kernels`).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from .cases import fill_pattern, make_spec


def p_child(args) -> int:
    """The cross-process P: allocate, fill the pattern, export; exit on a stdin line."""
    import torch
    from kvflow.cache import PagedKVCache
    from kvflow.connector.transport.cuda_ipc import export_cache, publish_export
    from kvflow.segments import unlink
    cache = PagedKVCache(make_spec(None, "NHD", "bfloat16"), args.num_blocks, device="cuda:0")
    fill_pattern(cache)
    torch.cuda.synchronize()
    name = publish_export(export_cache(cache), role="benchp")
    print(name, flush=True)
    try:
        sys.stdin.readline()
    finally:
        unlink(name)
    return 0


def run_xproc(a, kb, env, rows, run_kernels) -> None:
    """The cross-process rows beside :class:`.ipc.KernelBench` ``kb``'s (which gives up P),
    timed by ``run_kernels`` (:func:`.ipc.run_kernels`)."""
    import torch
    from kvflow.connector.transport.cuda_ipc import import_cache, read_export
    from kvflow.devices import worker_env
    p_index = int(os.environ.get("KVFLOW_BENCH_P_GPU", "0"))
    kb.P = None  # free GPU0 for the child's cache
    torch.cuda.empty_cache()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    phys = visible.split(",")[p_index] if visible else str(p_index)
    child = subprocess.Popen([sys.executable, "-m", "kvflow.bench", "ipc", "--p-child",
                              "--num-blocks", str(a.num_blocks)],
                             env=worker_env("cuda", int(phys)) if phys.isdigit() else
                             dict(os.environ, CUDA_VISIBLE_DEVICES=phys),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        if not name:
            raise RuntimeError(f"P child exited ({child.wait()}) without exporting its cache")
        exp = read_export(name)
        peer = import_cache(exp, kb.spec, a.num_blocks)
        print(f"\ncross-process: P pid {child.pid} exported {name}; mapped here on {peer.device}")
        run_kernels(a, kb, env, rows, xproc_peer=peer)
        old = peer.buffer.data_ptr()
        del peer
        gc.collect()
        torch.cuda.synchronize(kb.dd)
        torch.cuda.ipc_collect()
        # the same handle mapped into D's GPU context: the kernel runs on D's GPU (pull)
        peer = import_cache(exp, kb.spec, a.num_blocks, map_on=kb.dd)
        if peer.buffer.data_ptr() == old:
            print("cross-process pull skipped: torch returned the earlier mapping of the handle")
        else:
            print(f"\ncross-process: the same export mapped on {peer.device} (D's GPU)")
            run_kernels(a, kb, env, rows, xproc_peer=peer, variant="cross_process_mapped_on_d")
        del peer
    finally:
        child.stdin.close()
        child.wait(30)
