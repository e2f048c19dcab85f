"""One case of the kernel sweep: a cache, ``rot`` pre-built id sets and staging buffers, and the
calls the sweep times over them.

Two kinds of call per (op, backend, max_ctas), both rotating over the same pre-built arguments
(cold L2/LLC: :func:`kvflow.bench.timing.rotations_for`):

- **device time** (:meth:`KernelCase.fns`): ``validate=False``, so the timed figure is the
  kernels' (docs/design.md, "Measuring");
- **as called** (:meth:`KernelCase.fns` with ``as_called=True``): the op as a user calls it,
  default arguments except the backend being measured (and ``max_ctas`` in a grid-cap row):
  ids as tensors on the cache's device, ``validate`` left at its default.

Block ids are random (seeded): gather reads any ``n`` blocks, scatter writes ``n`` distinct ones,
copy moves ``n`` blocks to ``n`` other blocks of the same cache (disjoint sets).

``gather+digest``, ``scatter+digest``, ``copy+digest``: the op with ``digest=`` (``--kv-verify``,
:mod:`kvflow.kernels.digest`), into an int32 ``[n]`` buffer pre-built per rotation as a caller
would keep it; :meth:`KernelCase.verify` also checks the digest against the torch reference.
"""

from __future__ import annotations

from .cases import as_bytes, scramble


class KernelCase:
    """Buffers of one (spec, tokens) case: ``rot`` id sets and staging buffers.

    Parameters
    ----------
    cache : PagedKVCache
        The cache every op reads or writes (already filled).
    n : int
        Blocks per call.
    rot : int
        Id sets and staging buffers to rotate over.
    gen : torch.Generator
        Seeded generator of the block ids.
    """

    def __init__(self, cache, n: int, rot: int, gen) -> None:
        import torch

        from kvflow.cache import staging_buffer
        self.cache, self.n, self.rot = cache, n, rot
        dev = cache.device
        perms = [torch.randperm(cache.num_blocks, generator=gen) for _ in range(rot)]
        self.ids = [p[:n].to(dev) for p in perms]
        self.dst_ids = [p[n:2 * n].to(dev) for p in perms]
        self.digests = [torch.empty(n, dtype=torch.int32, device=dev) for _ in range(rot)]
        self.bufs = []
        for _ in range(rot):
            b = staging_buffer(cache.spec, n, device=dev)
            scramble(b)
            self.bufs.append(b)

    def fns(self, op: str, backend: str, max_ctas: int | None, *, as_called: bool = False) -> list:
        """``rot`` closures, one per pre-built argument set, each one call of ``op``.

        ``as_called=False`` passes ``validate=False`` (device time); ``as_called=True`` leaves
        ``validate`` at its default and passes ``max_ctas`` only when it is set, so the call is
        the one a user writes."""
        from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks
        c = self.cache
        kw = {"backend": backend}
        if max_ctas is not None or not as_called:
            kw["max_ctas"] = max_ctas
        if not as_called:
            kw["validate"] = False
        ids, dst, bufs = self.ids, self.dst_ids, self.bufs
        op, digest = _split(op)
        if digest:
            dg = self.digests
            if op == "gather":
                return [lambda i=i: gather_blocks(c, ids[i], bufs[i], digest=dg[i], **kw)
                        for i in range(self.rot)]
            if op == "scatter":
                return [lambda i=i: scatter_blocks(bufs[i], c, ids[i], digest=dg[i], **kw)
                        for i in range(self.rot)]
            return [lambda i=i: copy_blocks(c, c, ids[i], dst[i], digest=dg[i], **kw)
                    for i in range(self.rot)]
        if op == "gather":
            return [lambda i=i: gather_blocks(c, ids[i], bufs[i], **kw) for i in range(self.rot)]
        if op == "scatter":
            return [lambda i=i: scatter_blocks(bufs[i], c, ids[i], **kw) for i in range(self.rot)]
        return [lambda i=i: copy_blocks(c, c, ids[i], dst[i], **kw) for i in range(self.rot)]

    def verify(self, op: str, backend: str, max_ctas: int | None) -> bool:
        """Run the op once with ``backend`` and compare the bytes with the torch reference.

        The destination is overwritten with fresh random bytes first, so a backend that writes
        nothing cannot pass on what an earlier backend left there."""
        import torch

        from kvflow.cache import staging_buffer
        from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks
        from kvflow.kernels import block_digest
        c, ids, buf = self.cache, self.ids[0], self.bufs[0]
        ref = staging_buffer(c.spec, self.n, device=c.device)
        scramble(buf)
        op, digest = _split(op)
        kw = {"digest": self.digests[0]} if digest else {}
        ok = True
        if op == "gather":
            gather_blocks(c, ids, buf, backend=backend, max_ctas=max_ctas, **kw)
            gather_blocks(c, ids, ref, backend="torch")
        elif op == "scatter":
            scatter_blocks(buf, c, ids, backend=backend, max_ctas=max_ctas, **kw)
            gather_blocks(c, ids, ref, backend="torch")
        else:
            dst = self.dst_ids[0]
            scatter_blocks(buf, c, dst, backend="torch")  # dst blocks now differ from src blocks
            copy_blocks(c, c, ids, dst, backend=backend, max_ctas=max_ctas, **kw)
            gather_blocks(c, ids, ref, backend="torch")
            gather_blocks(c, dst, buf, backend="torch")
        if digest:
            ok = torch.equal(self.digests[0], block_digest(c, ids))
        return ok and torch.equal(as_bytes(buf), as_bytes(ref))


def _split(op: str) -> tuple[str, bool]:
    """``"gather+digest"`` -> ``("gather", True)``; ``"gather"`` -> ``("gather", False)``."""
    base, _, extra = op.partition("+")
    return base, extra == "digest"


def check_errors() -> None:
    """Raise any id error a device-side check recorded during the calls just timed, through
    ``kvflow.kernels.check_errors()`` where the kernels provide it (no-op before they do)."""
    import kvflow.kernels as k
    fn = getattr(k, "check_errors", None)
    if fn is not None:
        fn()
