"""The ``copy_engine`` backend: its copy plans (checked on the CPU by executing them with
``ctypes.memmove``, through the checked ops, against the torch reference byte for byte for
every layout and dtype, with -1 padding), its declared capabilities, that auto never picks
it, that connectors pass it through, and (``gpu``) the same on a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import PagedKVCache, staging_buffer
from kvflow.kernels import copy_blocks, copy_sequence, gather_blocks, scatter_blocks
from kvflow.kernels.copy_engine import CopyEngineBackend
from kvflow.kernels.copy_engine.plan import block_runs, gather_plan, make_plan, run_on_host
from kvflow.kernels.registry import _BACKENDS, AUTO_ORDER, get_backend

try:
    from tests.zmq_link import recv, zmq_link  # noqa: F401 (zmq_link: a fixture)
except ImportError:  # no pyzmq (a bare GPU host): the connector test skips
    recv = zmq_link = None
from tests.conftest import (DTYPES, GEOMETRY, LAYOUTS, assert_bytes_equal, cache_bytes, make_spec,
                            random_bytes_, random_cache)

HOST = "copy_engine_host"
CUDA = torch.cuda.is_available()


class _HostCopyEngine(CopyEngineBackend):
    """The backend with its plans executed by ``ctypes.memmove`` on CPU tensors."""

    name = HOST
    devices = {"cpu"}

    def unavailable_reason(self):
        return None

    @staticmethod
    def _execute(plan, device):
        run_on_host(plan)


@pytest.fixture
def host_backend():
    _BACKENDS[HOST] = _HostCopyEngine()
    yield HOST
    _BACKENDS.pop(HOST, None)


def test_block_runs_split_on_padding_and_gaps():
    s, d, n = block_runs(np.array([4, 5, -1, 7, 9, 10, 3]), np.arange(7), 12, 7)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([4, 7, 9, 3], [0, 3, 4, 6], [2, 1, 2, 1])
    s, d, n = block_runs(np.array([-1, -1]), np.array([0, 1]), 4, 4)
    assert s.size == d.size == n.size == 0
    # a pair skipped by its destination (out of range) breaks a run too
    s, d, n = block_runs(np.array([0, 1, 2]), np.array([5, 16, 7]), 4, 8)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 2], [5, 7], [1, 1])


def test_plan_spreads_runs_over_tensors_and_merges_continuing_copies():
    p = make_plan([1000, 5000], [100, 9000], 10, np.array([0, 1, 5]), np.array([3, 4, 0]), 8, 8)
    assert p.src.tolist() == [1000, 1050, 5000, 5050]
    assert p.dst.tolist() == [130, 100, 9030, 9000]
    assert p.size.tolist() == [20, 10, 20, 10] and p.runs == 2 and p.nbytes == 60
    # every block of a one-buffer cache, in order, into a staging buffer: one copy
    spec = make_spec("NHD", torch.float16)
    cache = PagedKVCache(spec, 6)
    out = staging_buffer(spec, 6)
    plan = gather_plan(cache, np.arange(6), out.data_ptr(), 0, spec.num_layers)
    assert (plan.count, plan.nbytes) == (1, cache.nbytes)
    assert plan.src.tolist() == [cache.buffer.data_ptr()] and plan.dst.tolist() == [out.data_ptr()]


def _ids(n_blocks, n, seed, unique, long_run=False):
    g = torch.Generator().manual_seed(seed)
    if long_run:
        ids = list(range(n_blocks - n, n_blocks))
    else:
        ids = (torch.randperm(n_blocks, generator=g)[:n] if unique
               else torch.randint(0, n_blocks, (n,), generator=g)).tolist()
    for p in (1, n - 2):
        ids[p] = -1
    return ids


def _check_all_ops(backend, device, layout, dtype, layers=None, long_run=False, idt=torch.int64):
    spec, g = make_spec(layout, dtype), GEOMETRY
    n = g.num_ids
    src_ids = torch.tensor(_ids(g.num_blocks, n, 3, False, long_run), dtype=idt, device=device)
    dst_ids = torch.tensor(_ids(g.num_blocks, n, 4, True, long_run), dtype=idt, device=device)
    cache = random_cache(spec, g.num_blocks, device, seed=1)
    outs = []
    for be in ("torch", backend):
        out = random_bytes_(staging_buffer(spec, n, layers, device=device), 9)
        outs.append(gather_blocks(cache, src_ids, out, layers, backend=be))
    assert_bytes_equal(outs[1], outs[0], f"gather {layout} {dtype}")
    caches = []
    for be in ("torch", backend):
        c = random_cache(spec, g.num_blocks, device, seed=2)
        scatter_blocks(outs[0], c, dst_ids, layers, backend=be)
        caches.append(cache_bytes(c))
    assert_bytes_equal(caches[1], caches[0], f"scatter {layout} {dtype}")
    caches = []
    for be in ("torch", backend):
        c = random_cache(spec, g.num_blocks, device, seed=2)
        copy_blocks(cache, c, src_ids, dst_ids, layers, backend=be)
        caches.append(cache_bytes(c))
    assert_bytes_equal(caches[1], caches[0], f"copy {layout} {dtype}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layers", [None, (1, 3)])
def test_host_plans_match_the_reference(host_backend, layout, dtype, layers):
    _check_all_ops(host_backend, "cpu", layout, dtype, layers, idt=torch.int32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_plans_one_long_run(host_backend, layout):
    _check_all_ops(host_backend, "cpu", layout, torch.bfloat16, long_run=True)


def test_a_repeated_call_reuses_its_plan_and_new_ids_get_a_new_one(host_backend):
    spec = make_spec("NHD", torch.bfloat16)
    cache = random_cache(spec, 8, seed=5)
    out = staging_buffer(spec, 3)
    gather_blocks(cache, [2, 3, -1], out, backend=host_backend)
    plan = cache.backend_state["copy_engine"][1]
    gather_blocks(cache, [2, 3, -1], out, backend=host_backend)
    assert cache.backend_state["copy_engine"][1] is plan
    gather_blocks(cache, [2, 4, -1], out, backend=host_backend)
    assert cache.backend_state["copy_engine"][1] is not plan
    want = gather_blocks(cache, [2, 4, -1], staging_buffer(spec, 3).zero_(), backend="torch")
    assert_bytes_equal(out[:, :, :2], want[:, :, :2], "after a new plan")


def test_capabilities_it_lacks_get_the_contract_errors(host_backend):
    spec = make_spec("NHD", torch.bfloat16)
    a, b = random_cache(spec, 8, seed=1), random_cache(spec, 8, seed=2)
    with pytest.raises(ValueError, match=f"backend '{HOST}' cannot move blocks between "
                                         f"different specs"):
        copy_sequence(a, PagedKVCache(spec.with_(block_size=8), 8), [0], [0], num_tokens=4,
                      backend=host_backend)
    digest = torch.zeros(2, dtype=torch.int32)  # computed by the reference after the copy
    want = torch.zeros(2, dtype=torch.int32)
    copy_blocks(a, b, [1, 2], [3, 4], backend=host_backend, digest=digest)
    copy_blocks(a, random_cache(spec, 8, seed=2), [1, 2], [3, 4], backend="torch", digest=want)
    assert digest.tolist() == want.tolist() and digest.ne(0).all()


def test_auto_never_picks_it_and_without_cuda_it_says_why():
    assert all("copy_engine" not in order for order in AUTO_ORDER.values())
    if CUDA:
        pytest.skip("CUDA is here")
    reason = CopyEngineBackend().unavailable_reason()
    assert reason == "no CUDA device" or reason.startswith("cuda-bindings is not importable")
    with pytest.raises(RuntimeError, match="backend='copy_engine' is unavailable: "):
        get_backend("copy_engine", torch.device("cuda"))


def test_connectors_pass_the_backend_through(host_backend, request):
    """The backend is a string handed to the ops: the tcp connector moves a request with the
    copy-engine plans, and the serve and vLLM configs accept ``copy_engine``."""
    if recv is None:
        pytest.skip("pyzmq is not installed")
    from kvflow.connector import make_receiver
    from kvflow.connector.tcp import TcpSender
    from kvflow.integrations.vllm.config import check_config
    from kvflow.serve.launch.checks import BACKEND_NAMES
    assert "copy_engine" in BACKEND_NAMES
    assert check_config({"backend": "copy_engine"})["backend"] == "copy_engine"
    spec = make_spec("HND", torch.float16)
    p, d = random_cache(spec, 12, seed=1), random_cache(spec, 16, seed=2)
    want = random_cache(spec, 16, seed=2)
    copy_blocks(p, want, [7, 2, 9, 0], [1, 5, 3, 11], backend="torch")
    p_sock, d_sock = request.getfixturevalue("zmq_link")
    TcpSender(spec, backend=host_backend).send(p_sock, "r", p, [7, 2, 9, 0], first_token=1,
                                               num_prompt_tokens=13)
    head, payload = recv(d_sock)
    rx = make_receiver("tcp", backend=host_backend)
    assert rx.backend == host_backend
    rx.receive(head, payload, d, [1, 5, 3, 11])
    assert_bytes_equal(cache_bytes(d), cache_bytes(want), "tcp with copy-engine plans")


gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_matches_the_reference(layout, dtype):
    _check_all_ops("copy_engine", "cuda", layout, dtype)
    _check_all_ops("copy_engine", "cuda", layout, dtype, (1, 3), idt=torch.int32)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", ["batch", "per_run"])
def test_gpu_long_run_and_many_runs_on_each_path_and_stream(layout, path, monkeypatch):
    from kvflow.kernels.copy_engine import launch
    if path == "batch" and launch._driver().batch is None:
        pytest.skip("driver has no cuMemcpyBatchAsync")
    monkeypatch.setenv("KVFLOW_COPY_ENGINE_PATH", path)
    _check_all_ops("copy_engine", "cuda", layout, torch.bfloat16, long_run=True)
    with torch.cuda.stream(torch.cuda.Stream()):  # not the legacy stream: no side stream
        _check_all_ops("copy_engine", "cuda", layout, torch.bfloat16)
    torch.cuda.synchronize()


@pytest.mark.gpu
@gpu
def test_gpu_refuses_graph_capture():
    spec = make_spec("NHD", torch.bfloat16)
    cache = random_cache(spec, 8, "cuda", seed=1)
    out = staging_buffer(spec, 2, device="cuda")
    ids = torch.tensor([1, 2], device="cuda")
    gather_blocks(cache, ids, out, backend="copy_engine", validate=False)
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            gather_blocks(cache, ids, out, backend="copy_engine", validate=False)
