"""Shared fixtures and helpers for kvflow's tests.

The same files run on the CPU CI machine (small shapes, ``device="cpu"``) and on a GPU host
(``KVFLOW_TEST_SCALE=large`` for bigger shapes; ``"cuda"`` joins :data:`DEVICES`).
Without CUDA, Triton kernels run in Triton's CPU interpreter, so ``TRITON_INTERPRET=1`` is set
here, before anything imports triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' result files are never "busy" (kvflow/bench/load.py): a report test must not
# depend on the load of the machine that runs it (a loaded CI run left its rows out);
# tests/bench/test_bench_load.py tests the rule itself without this.
os.environ["KVFLOW_BUSY_LOAD_PER_CPU"] = "1e9"

from kvflow.shadow import unshadow_kernels  # noqa: E402

unshadow_kernels()  # before any test imports transformers (python -m pytest puts the root first)

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from kvflow import KVCacheSpec, PagedKVCache  # noqa: E402
from kvflow.kernels import available_backends  # noqa: E402
from kvflow.kernels.registry import get_backend  # noqa: E402

# every row of kvflow.layout.LAYOUT_TABLE; block-major rows only where a backend takes
# block strides (kernels/contract.py: block_strides; see takes_block_major)
LAYER_MAJOR = ("NHD", "HND", "MLA", "LBHNC", "LBNHC")
LAYOUTS = LAYER_MAJOR + ("BM_NHD",)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

#: "small" (default; CPU CI) or "large" (GPU host): picks :data:`GEOMETRY`.
SCALE = os.environ.get("KVFLOW_TEST_SCALE", "small").strip().lower() or "small"
if SCALE not in ("small", "large"):
    raise ValueError(f"KVFLOW_TEST_SCALE must be 'small' or 'large', got {SCALE!r}")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes of the op tests: a cache of ``num_blocks`` blocks, ``num_ids`` ids per call."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    num_ids: int


GEOMETRY = {
    "small": Geometry(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16, num_ids=7),
    "large": Geometry(num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=128,
                      num_ids=96),
}[SCALE]


def make_spec(layout: str, dtype: torch.dtype, geo: Geometry = GEOMETRY) -> KVCacheSpec:
    """The test spec of a layout (MLA: one latent of ``heads * head_dim`` per token)."""
    heads, dim = (1, geo.num_kv_heads * geo.head_dim) if layout == "MLA" else \
        (geo.num_kv_heads, geo.head_dim)
    return KVCacheSpec(num_layers=geo.num_layers, num_kv_heads=heads, head_dim=dim,
                       block_size=geo.block_size, dtype=dtype, layout=layout)


def takes_block_major(backend: str, device: str = "cpu") -> bool:
    """Whether ``backend`` moves block-major caches (``block_strides``, kernels/contract.py)."""
    return bool(getattr(get_backend(backend, torch.device(device)), "block_strides", False))



def backends_for(device: str) -> list[str]:
    """Names of backends that are available here and run on ``device``'s type."""
    dev = torch.device(device)
    names = []
    for name, state in available_backends().items():
        if state != "available":
            continue
        try:
            get_backend(name, dev)
        except ValueError:  # runs on other device types
            continue
        names.append(name)
    return names


def random_bytes_(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill ``t`` in place with random bytes in 1..255 (never 0, so an untouched or zeroed
    byte is told apart); the values are bit patterns, NaNs included. Returns ``t``."""
    g = torch.Generator().manual_seed(seed)
    u8 = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    u8.copy_(torch.randint(1, 256, u8.shape, dtype=torch.uint8, generator=g).to(t.device))
    return t


def random_cache(spec: KVCacheSpec, num_blocks: int, device: str = "cpu",
                 seed: int = 0) -> PagedKVCache:
    """A cache whose every byte is random (and non-zero)."""
    cache = PagedKVCache(spec, num_blocks, device)
    for i, t in enumerate(cache.tensors()):
        random_bytes_(t, seed * 1000 + i)
    return cache


def cache_bytes(cache: PagedKVCache) -> torch.Tensor:
    """Every byte of every tensor of ``cache`` (in ``tensors()`` order) as one CPU uint8 tensor."""
    return torch.cat([t.reshape(-1).view(torch.uint8).cpu() for t in cache.tensors()])


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Byte-for-byte equality, naming the first differing byte."""
    a = actual.contiguous().reshape(-1).view(torch.uint8).cpu()
    e = expected.contiguous().reshape(-1).view(torch.uint8).cpu()
    assert a.shape == e.shape, f"{what}: {a.numel()} bytes vs {e.numel()} expected"
    diff = (a != e).nonzero()
    if diff.numel():
        i = int(diff[0, 0])
        raise AssertionError(f"{what}: {diff.numel()} of {a.numel()} bytes differ, first at byte "
                             f"{i}: {int(a[i])} vs {int(e[i])} expected")


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _no_process_left():
    """After the session, no process of a :func:`tests.reap.spawn`ed group still runs: a test
    that left one fails here (and its groups are reaped), instead of leaving engines behind."""
    yield
    from tests.reap import reap_all
    left = reap_all()
    assert not left, "processes left running by the tests (now reaped):\n" + "\n".join(left)
