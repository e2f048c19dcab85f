"""Build configuration of ``kvflow._native`` (imported by setup.py by file path).

Without ``KVFLOW_XPU_SDK``: the host backend only (C++17, -O3, pthread, no SDK). With
``KVFLOW_XPU_SDK=<root>`` naming a Kunlun XRE installation (``<root>/include/xpu/runtime.h``
and ``libxpurt.so`` under ``<root>/so``, ``lib`` or ``lib64`` -- e.g. the ``xpu/`` folder inside
a paddle-xpu or XRE tarball): also ``xpu/src/xpu_runtime.cc``, ``-DKVFLOW_WITH_XPU=1``, the
SDK's include/library folders (with an rpath) and ``-lxpurt``.
"""

from __future__ import annotations

import os
from glob import glob

HERE = os.path.dirname(os.path.abspath(__file__))
XPU_ONLY_SOURCES = ("xpu_runtime.cc",)


def xpu_sdk(env=None):
    """``(include_dirs, library_dirs)`` of the SDK named by ``KVFLOW_XPU_SDK``, or None if unset.

    Raises
    ------
    RuntimeError
        The variable names a folder without ``include/xpu/runtime.h`` or ``libxpurt.so``.
    """
    root = (os.environ if env is None else env).get("KVFLOW_XPU_SDK", "").strip()
    if not root:
        return None
    inc = os.path.join(root, "include")
    if not os.path.isfile(os.path.join(inc, "xpu", "runtime.h")):
        raise RuntimeError(f"KVFLOW_XPU_SDK={root!r} has no include/xpu/runtime.h (an XRE install)")
    libs = [d for d in (os.path.join(root, s) for s in ("so", "lib", "lib64"))
            if glob(os.path.join(d, "libxpurt.so*"))]
    if not libs:
        raise RuntimeError(f"KVFLOW_XPU_SDK={root!r} has no libxpurt.so under so/, lib/ or lib64/")
    return [inc], libs


def extension_kwargs(env=None, root: str = "."):
    """``(sources, kwargs, variant)`` for ``Pybind11Extension("kvflow._native", ...)``; paths
    relative to the project ``root``; ``variant`` is the build-log line's text."""
    sdk = xpu_sdk(env)
    sources = sorted(os.path.relpath(p, root) for p in glob(os.path.join(HERE, "src", "*.cc")))
    kwargs = dict(include_dirs=[os.path.relpath(os.path.join(HERE, "include"), root)], cxx_std=17,
                  extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"])
    if sdk is None:
        sources = [s for s in sources if os.path.basename(s) not in XPU_ONLY_SOURCES]
        variant = "host backend (no KVFLOW_XPU_SDK)"
    else:
        inc, libs = sdk
        kwargs["include_dirs"] += inc
        kwargs.update(library_dirs=libs, runtime_library_dirs=libs, libraries=["xpurt"],
                      define_macros=[("KVFLOW_WITH_XPU", "1")])
        variant = f"host + xpu backends (KVFLOW_XPU_SDK={(os.environ if env is None else env)['KVFLOW_XPU_SDK']})"
    return sources, kwargs, variant
