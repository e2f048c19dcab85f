"""What both numba CPU kernels share (:mod:`.cpu`'s copy runs, :mod:`.reblock`'s re-blocked
copy): an int64 address as a pointer, when a call is worth numba's thread pool, and the serial
and parallel builds of one kernel (:func:`serial_and_parallel`).

``as_ptr(addr)`` reinterprets an int64 address as a ``void*`` inside an ``@njit`` function, so
``numba.carray(as_ptr(addr), n, dtype)`` views memory that a torch tensor owns without passing
the tensor (a kernel takes a table of base addresses, built once per cache).
"""

from __future__ import annotations

import types as _pytypes

import numba
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


def serial_and_parallel(fn):
    """``fn`` compiled twice, serial and with ``parallel=True`` (both ``nogil``, cached on disk).

    numba names a function's cache entries by module, ``__qualname__`` and first line, and its
    index does not tell a parallel build from a serial one: two dispatchers of one function share
    the entries, so whichever compiled first is loaded by both (2026-12-03: the parallel copy
    loaded the serial build, 2-4x slower on 2 cores). The parallel build is compiled from a
    copy of ``fn`` under its own name, ``<name>_parallel``."""
    twin = _pytypes.FunctionType(fn.__code__, fn.__globals__, f"{fn.__name__}_parallel",
                                 fn.__defaults__, fn.__closure__)
    twin.__qualname__ = f"{fn.__qualname__}_parallel"
    twin.__doc__, twin.__module__ = fn.__doc__, fn.__module__
    return (numba.njit(cache=True, nogil=True)(fn),
            numba.njit(parallel=True, cache=True, nogil=True)(twin))
