"""What both numba CPU kernels share (:mod:`.cpu`'s copy runs, :mod:`.reblock`'s re-blocked
copy): an int64 address as a pointer, and when a call is worth numba's thread pool.

``as_ptr(addr)`` reinterprets an int64 address as a ``void*`` inside an ``@njit`` function, so
``numba.carray(as_ptr(addr), n, dtype)`` views memory that a torch tensor owns without passing
the tensor (a kernel takes a table of base addresses, built once per cache).
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Copies of fewer payload bytes than this run on the calling thread: waking numba's thread
# pool costs more than it saves for small copies, and under load (a server's decode loop and
# transfer thread on 2 cores) a wake-up alone took milliseconds (issue #16).
PARALLEL_MIN_BYTES = 4 << 20


@intrinsic
def as_ptr(typingctx, addr):
    """Reinterpret an int64 address as a void pointer (for ``numba.carray``)."""
    sig = types.voidptr(addr)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return sig, codegen
