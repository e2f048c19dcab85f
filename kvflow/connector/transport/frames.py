"""Layer frames: a staging buffer sent as one zero-copy frame per layer (:func:`layer_frames`;
frame ``l`` is ``staging[l]`` of :func:`kvflow.cache.staging_shape`, :func:`layer_bytes` bytes),
the receiver's "check every frame, then scatter" (:func:`scatter_frames`) and the compile of
both ends' kernels (:func:`warm_staging`); for the ``tcp`` kind and the vLLM ``tcp`` transport.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from kvflow.cache import staging_shape
from kvflow.kernels import scatter_blocks


def layer_frames(staging: torch.Tensor) -> list[memoryview]:
    """Zero-copy frames of a host staging buffer ``[num_layers, ...]``: frame ``l`` is a
    memoryview of ``staging[l]``'s bytes (keep ``staging`` alive until ZMQ has sent them)."""
    raw = staging.view(-1).view(torch.uint8).view(staging.shape[0], -1)
    return [memoryview(raw[l].numpy()) for l in range(raw.shape[0])]


def frame_tensor(buf: memoryview, spec, num_blocks: int, layer: int,
                 device: torch.device) -> torch.Tensor:
    """One received layer frame as ``staging_shape(spec, num_blocks, layer)`` of ``spec.dtype``
    on ``device`` (copied to a GPU, viewed without a copy on the CPU)."""
    with warnings.catch_warnings():  # zmq frames are read-only; scatter only reads them
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(buf, dtype=torch.uint8)
    src = src.view(spec.dtype).view(staging_shape(spec, num_blocks, layer))
    return src if device.type == "cpu" else src.to(device)


def layer_bytes(spec, num_blocks: int) -> int:
    """Bytes of one layer frame: ``tensors_per_layer * num_blocks * block_bytes``."""
    return spec.tensors_per_layer * num_blocks * spec.block_bytes


def check_frames(frames: Sequence[Any], layers: range, nbytes: int, *, req_id: str,
                 error: type[Exception], count_msg: str, size_msg: str,
                 num_frames: int | None = None) -> list[memoryview]:
    """Check that there is one frame per layer of ``layers``, each of ``nbytes`` bytes
    (:func:`layer_bytes`); returns one memoryview per layer.

    ``frames``: zmq.Frame, memoryview or bytes, in layer order. On a mismatch raises ``error``
    with ``count_msg`` (``str.format`` fields ``req_id``, ``start``, ``stop``, ``expected``,
    ``header`` (``num_frames``, the count a header announced, which must match too), ``got``)
    or ``size_msg`` (fields ``req_id``, ``layer``, ``nbytes``, ``expected``).
    """
    if len(frames) != len(layers) or (num_frames is not None and num_frames != len(layers)):
        raise error(count_msg.format(req_id=req_id, start=layers.start, stop=layers.stop,
                                     expected=len(layers), header=num_frames, got=len(frames)))
    bufs = [memoryview(getattr(frame, "buffer", frame)) for frame in frames]
    for layer, buf in zip(layers, bufs):  # check every frame before writing anything
        if buf.nbytes != nbytes:
            raise error(size_msg.format(req_id=req_id, layer=layer, nbytes=buf.nbytes,
                                        expected=nbytes))
    return bufs


def scatter_frames(frames: Sequence[Any], cache, dst_ids: Any, layers: range, *,
                   req_id: str, error: type[Exception], count_msg: str, size_msg: str,
                   num_frames: int | None = None, spec=None, num_blocks: int | None = None,
                   backend: str = "auto", on_layer: Callable[[], None] | None = None,
                   src_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   **scatter_kw: Any) -> int:
    """Check every frame (:func:`check_frames`, same arguments), then scatter each layer into D's
    ``cache`` at ``dst_ids`` (int64 tensor [n]; -1 skips a slot). ``spec``: the frames' (P's when
    re-blocked; default ``cache.spec``); ``num_blocks``: per frame (default ``len(dst_ids)``);
    ``on_layer()`` after each layer; ``src_fn`` maps each layer's tensor first (a test fault);
    ``scatter_kw`` to ``scatter_blocks``. Returns the bytes scattered (0 when no id is >= 0); raises
    as :func:`check_frames`, before any write.
    """
    spec = cache.spec if spec is None else spec
    n = len(dst_ids) if num_blocks is None else num_blocks
    bufs = check_frames(frames, layers, layer_bytes(spec, n), req_id=req_id, error=error,
                        count_msg=count_msg, size_msg=size_msg, num_frames=num_frames)
    write = bool((torch.as_tensor(dst_ids) >= 0).any())
    total = 0
    for layer, buf in zip(layers, bufs if write else ()):
        src = frame_tensor(buf, spec, n, layer, cache.device)
        if src_fn is not None:
            src = src_fn(src)
        scatter_blocks(src, cache, dst_ids, layer, backend=backend, **scatter_kw)
        if on_layer is not None:
            on_layer()
        total += buf.nbytes
    return total


def warm_staging(spec: Any, device: Any, backend: str, scatter: bool = False) -> None:
    """Compile :func:`~kvflow.kernels.gather_blocks` (``scatter``: ``scatter_blocks``) on one
    block of a scratch cache of ``spec``."""
    from kvflow.cache import PagedKVCache, staging_buffer
    from kvflow.kernels import gather_blocks
    cache, one = PagedKVCache(spec, 2, device=device), staging_buffer(spec, 1, device=device)
    scatter_blocks(one, cache, [1], backend=backend) if scatter else \
        gather_blocks(cache, [1], one, backend=backend)
