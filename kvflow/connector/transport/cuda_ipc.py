"""CUDA IPC export and import of a paged cache (P's for ipc-pull on GPU, D's for ipc-push): one
allocation exported once (:func:`export_cache`) with its GPU's UUID, published in a 0600 file
(:func:`publish_export`) named in ``Register`` / ``Pair``, opened once at pairing
(:func:`import_cache`). docs/gpu_serving.md, "How the GPUs are paired".
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch

from kvflow.cache import PagedKVCache
from kvflow.layout import KVCacheSpec
from kvflow.scales import scales_offset, shared_nbytes, shared_parts

from . import TransferError
from kvflow.segments import segment_path

EXPORT_VERSION = 2  # 2: nbytes counts the fp8 scales after the blocks


class CudaIpcExport(msgspec.Struct, forbid_unknown_fields=True):
    """Everything a peer needs to map the exporter's cache (:func:`encode_export`); ``handle`` ..
    ``event_sync_required`` are torch's ``UntypedStorage._share_cuda_()``."""

    uuid: str  # of the GPU holding the allocation (:func:`device_uuid` form)
    pci_bus_id: str  # of that GPU (for messages)
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    buffer_offset: int  # of the cache in the storage, bytes
    nbytes: int  # the blocks, then (fp8) the scales: kvflow.scales.shared_nbytes
    num_blocks: int
    spec: dict[str, Any]  # KVCacheSpec.to_dict(), checked at import
    pid: int  # the exporter's
    version: int = EXPORT_VERSION


def _norm_uuid(u: Any) -> str:
    return str(u).strip().lower().removeprefix("gpu-")


def device_uuid(index: int) -> str:
    """UUID of visible CUDA device ``index`` (lower case, without the ``GPU-`` prefix)."""
    return _norm_uuid(torch.cuda.get_device_properties(index).uuid)


def _pci_bus_id(index: int) -> str:
    p = torch.cuda.get_device_properties(index)
    dom, bus, dev = (getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    return "unknown" if bus is None else f"{dom or 0:08x}:{bus:02x}:{dev or 0:02x}.0"


def ordinal_of_uuid(uuid: str) -> int:
    """This process's CUDA ordinal of the GPU with ``uuid``. TransferError (naming it, the
    visible UUIDs and ``CUDA_VISIBLE_DEVICES``) when no visible GPU has it."""
    want = _norm_uuid(uuid)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    seen = [device_uuid(i) for i in range(n)]
    if want in seen:
        return seen.index(want)
    raise TransferError(f"the prefill cache is on GPU {want}, which this process cannot see "
                        f"(visible: {seen or 'no CUDA device'}; CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); include it in the decode "
                        f"instance's CUDA_VISIBLE_DEVICES")


def enable_peer_access(a: torch.device, b: torch.device) -> None:
    """Enable peer access both ways between CUDA devices ``a`` and ``b`` (torch does, on its
    first cross-device copy each way). TransferError when they cannot access each other."""
    if a == b:
        return
    if not (torch.cuda.can_device_access_peer(a.index, b.index)
            and torch.cuda.can_device_access_peer(b.index, a.index)):
        raise TransferError(f"{a} and {b} cannot access each other's memory (no peer access)")
    x, y = torch.zeros(1, device=a), torch.zeros(1, device=b)
    y.copy_(x)
    x.copy_(y)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


def export_cache(cache: PagedKVCache) -> CudaIpcExport:
    """Export ``cache`` (over one flat CUDA ``buffer``) for another process. TypeError when it
    has no ``buffer``, is not on CUDA, or is fp8 with its scales outside the buffer."""
    buf = cache.buffer
    if buf is None or buf.device.type != "cuda":
        raise TypeError(f"cache must be a PagedKVCache over one CUDA buffer, got one on "
                        f"{cache.device} with buffer={'None' if buf is None else 'set'}")
    spec, nb = cache.spec, cache.num_blocks
    if cache.scales is not None \
            and cache.scales.data_ptr() != buf.data_ptr() + scales_offset(spec, nb):
        raise TypeError("the fp8 cache's scales are not in its buffer, so an importer would not "
                        "see them; build it with PagedKVCache(..., scales_in_buffer=True)")
    (_, handle, size, offset, rc_handle, rc_offset, ev_handle,
     ev_sync) = buf.untyped_storage()._share_cuda_()
    idx = buf.device.index
    return CudaIpcExport(uuid=device_uuid(idx), pci_bus_id=_pci_bus_id(idx), handle=bytes(handle),
                         storage_size=int(size), storage_offset=int(offset),
                         ref_counter_handle=bytes(rc_handle or b""),
                         ref_counter_offset=int(rc_offset or 0),
                         event_handle=bytes(ev_handle or b""), event_sync_required=bool(ev_sync),
                         buffer_offset=buf.storage_offset(), nbytes=shared_nbytes(spec, nb),
                         num_blocks=cache.num_blocks, spec=cache.spec.to_dict(), pid=os.getpid())


def encode_export(exp: CudaIpcExport) -> bytes:
    """MessagePack bytes of ``exp``."""
    return msgspec.msgpack.encode(exp)


def decode_export(data: bytes) -> CudaIpcExport:
    """Inverse of :func:`encode_export`; TransferError unless a version-``EXPORT_VERSION``
    export."""
    try:
        exp = msgspec.msgpack.decode(data, type=CudaIpcExport)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TransferError(f"not a CUDA IPC export ({len(data)} bytes): {exc}") from None
    if exp.version != EXPORT_VERSION:
        raise TransferError(f"CUDA IPC export version {exp.version}; expected {EXPORT_VERSION}")
    return exp


def publish_export(exp: CudaIpcExport, role: str = "cudaipc") -> str:
    """Write ``exp`` to a new 0600 shared-memory file; returns its segment name
    (:func:`kvflow.segments.create`)."""
    from kvflow import segments
    data = encode_export(exp)
    name, fd = segments.create(role, len(data))
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return name


def read_export(name: str) -> CudaIpcExport:
    """Read a published export by segment name; TransferError when the file is missing or
    holds no export."""
    try:
        with open(segment_path(name), "rb") as f:
            return decode_export(f.read())
    except FileNotFoundError:
        raise TransferError(f"CUDA IPC export {name!r} does not exist (prefill gone?)") from None


def import_cache(exp: CudaIpcExport, spec: KVCacheSpec, num_blocks: int | None = None, *,
                 map_on: torch.device | None = None) -> PagedKVCache:
    """Open a peer's exported cache here (once, at pairing) as a :class:`PagedKVCache` over the
    mapped memory (fp8 scales: the exporter's). ``spec`` must equal the exported one, ``num_blocks``
    what ``Pair`` said; ``map_on``: the GPU whose kernels will use it (default the owner's).
    TransferError: a UUID not visible here, a spec or size mismatch, an export of this process, or a
    failed open.
    """
    theirs = KVCacheSpec.from_dict(exp.spec)
    if theirs != spec:
        raise TransferError("CUDA IPC export spec mismatch: " + "; ".join(spec.diff(theirs)))
    if num_blocks is not None and num_blocks != exp.num_blocks:
        raise TransferError(f"CUDA IPC export has {exp.num_blocks} blocks; pairing said "
                            f"{num_blocks}")
    need = shared_nbytes(spec, exp.num_blocks)
    if exp.nbytes != need or exp.buffer_offset + exp.nbytes > exp.storage_size:
        raise TransferError(f"CUDA IPC export is inconsistent: {exp.nbytes} bytes at offset "
                            f"{exp.buffer_offset} of a {exp.storage_size}-byte storage; "
                            f"{exp.num_blocks} blocks of {spec.bytes_per_block} bytes need "
                            f"{need}" + shared_parts(spec, exp.num_blocks))
    if exp.pid == os.getpid():
        raise TransferError("CUDA IPC export was made by this process; use the cache directly")
    owner = ordinal_of_uuid(exp.uuid)
    ordinal = owner if map_on is None else torch.device(map_on).index
    if ordinal != owner:
        enable_peer_access(torch.device("cuda", ordinal), torch.device("cuda", owner))
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            ordinal, exp.handle, exp.storage_size, exp.storage_offset, exp.ref_counter_handle,
            exp.ref_counter_offset, exp.event_handle, exp.event_sync_required)
    except RuntimeError as exc:
        raise TransferError(f"cannot open the CUDA IPC handle of pid {exp.pid} on GPU {exp.uuid} "
                            f"(cuda:{ordinal} here): {exc}") from None
    buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ordinal}")
    buf.set_(storage, exp.buffer_offset, (exp.nbytes,), (1,))
    cache = PagedKVCache(spec, exp.num_blocks, buffer=buf, scales_in_buffer=True)
    cache.backend_state["cuda_ipc"] = {"uuid": exp.uuid, "pid": exp.pid, "owner": owner}
    return cache
