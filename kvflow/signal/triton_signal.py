"""``signal_layer``: a stream-ordered GPU store of "layer l of step s is complete".

Grid ``(1,)``, one warp. The one program adds 1 to the layer's ``count`` (relaxed) and then
stores ``step`` into the layer's slot with **release** semantics at **system** scope, so every
write that happened before it on the stream (the layer's KV writes, by stream order) is visible
to a host reader that sees the new step (the PTX memory model's release/acquire, cumulative).
The slots live in a host-registered shared-memory segment (:mod:`kvflow.signal.segment`), so
the store crosses PCIe to host memory; a reader in any process polls it.

Two ways to store ``step`` (``store=``):

``"atomic"`` (default)
    ``tl.atomic_xchg(..., sem="release", scope="sys")``.
``"asm"``
    A plain ``st.release.sys.global.b64`` (inline PTX, sm_70+), which needs no PCIe atomics
    (GPU only; Triton's CPU interpreter cannot run PTX).

Under ``TRITON_INTERPRET=1`` the same kernel runs on the CPU over a CPU view of the segment,
which is how the tests exercise it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segment import HEADER_BYTES, SLOT_WORDS

STORES = ("atomic", "asm")


@triton.jit(do_not_specialize=["layer", "step"])
def _signal_layer_kernel(words_ptr, layer, step, FIRST_SLOT: tl.constexpr,
                         SLOT_W: tl.constexpr, ASM: tl.constexpr):
    slot = words_ptr + FIRST_SLOT + layer * SLOT_W  # layer < 2**16: no int32 overflow
    tl.atomic_add(slot + 1, 1, sem="relaxed", scope="sys")
    if ASM:
        ptrs = slot + tl.arange(0, 1)
        vals = tl.zeros([1], tl.int64) + step
        tl.inline_asm_elementwise(
            "st.release.sys.global.b64 [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,l", [ptrs, vals], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(slot, step.to(tl.int64), sem="release", scope="sys")


def signal_layer(words: torch.Tensor, layer: int, step: int, *, num_layers: int,
                 store: str = "atomic") -> None:
    """Enqueue the signal of ``layer`` at ``step`` on the current stream.

    Parameters
    ----------
    words : torch.Tensor, int64, 1-D
        The whole segment as int64 words: a CPU tensor over the mapping (host-registered with
        CUDA when the kernel runs on a GPU; Triton resolves the device pointer), or a CPU
        tensor under ``TRITON_INTERPRET=1``.
    layer : int
        In ``[0, num_layers)``.
    step : int
        Prefill step, ``>= 0``.
    num_layers : int
        Layers of the segment (checked against ``words``' length).
    store : {"atomic", "asm"}
        How the step is stored (module docstring).

    Raises
    ------
    ValueError
        Naming the bad argument and its value.
    """
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int64 or words.dim() != 1:
        raise ValueError(f"words must be a 1-D int64 tensor over the segment, got "
                         f"{getattr(words, 'dtype', type(words))}")
    if words.numel() * 8 < HEADER_BYTES + num_layers * SLOT_WORDS * 8:
        raise ValueError(f"words holds {words.numel()} words, too few for {num_layers} layers")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in [0, {num_layers}), got {layer!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    _signal_layer_kernel[(1,)](words, layer, step, FIRST_SLOT=HEADER_BYTES // 8,
                               SLOT_W=SLOT_WORDS, ASM=store == "asm", num_warps=1)
