"""Build glue: package discovery for the two source roots (``kvflow/`` and ``kernels/``, the
latter imported as ``kvflow.kernels``), and the native extension ``kvflow._native`` (``xpu/``).
Metadata lives in pyproject.toml.

``kvflow._native`` is always built with its host backend (C++17, pybind11, no SDK). When
``KVFLOW_XPU_SDK`` names a Kunlun XRE installation (a folder with ``include/xpu/runtime.h`` and
``so/`` or ``lib/`` holding ``libxpurt.so``), the XPU variant is added: ``-DKVFLOW_WITH_XPU``,
``xpu/src/xpu_runtime.cc``, and a link against ``xpurt``. The build log says which was built.
"""

import os
from glob import glob

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

packages = ["kvflow"] + [f"kvflow.{p}" for p in find_packages("kvflow")]
packages += ["kvflow.kernels"] + [f"kvflow.kernels.{p}" for p in find_packages("kernels")]
package_dir = {"kvflow": "kvflow", "kvflow.kernels": "kernels"}


def _xpu_sdk():
    """(include_dirs, library_dirs) of the Kunlun SDK named by KVFLOW_XPU_SDK, or None."""
    root = os.environ.get("KVFLOW_XPU_SDK", "").strip()
    if not root:
        return None
    inc = os.path.join(root, "include")
    if not os.path.isfile(os.path.join(inc, "xpu", "runtime.h")):
        raise RuntimeError(f"KVFLOW_XPU_SDK={root!r} has no include/xpu/runtime.h (an XRE install)")
    libs = [d for d in (os.path.join(root, "so"), os.path.join(root, "lib"), os.path.join(root, "lib64"))
            if glob(os.path.join(d, "libxpurt.so*"))]
    if not libs:
        raise RuntimeError(f"KVFLOW_XPU_SDK={root!r} has no libxpurt.so under so/, lib/ or lib64/")
    return [inc], libs


def _native_extension():
    from pybind11.setup_helpers import Pybind11Extension

    sdk = _xpu_sdk()
    sources = sorted(glob("xpu/src/*.cc"))
    kwargs = dict(include_dirs=["xpu/include"], cxx_std=17,
                  extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"])
    if sdk is None:
        sources.remove("xpu/src/xpu_runtime.cc")
    else:
        inc, libs = sdk
        kwargs["include_dirs"] += inc
        kwargs.update(library_dirs=libs, runtime_library_dirs=libs, libraries=["xpurt"],
                      define_macros=[("KVFLOW_WITH_XPU", "1")])
    # optional: without a C++ compiler the rest of kvflow still installs, and
    # kvflow.kernels.available_backends()["native"] says why the extension is missing.
    ext = Pybind11Extension("kvflow._native", sources, optional=True, **kwargs)
    ext.kvflow_variant = ("host backend (no KVFLOW_XPU_SDK)" if sdk is None
                          else f"host + xpu backends (KVFLOW_XPU_SDK={os.environ['KVFLOW_XPU_SDK']})")
    return ext


class BuildExt(build_ext):
    """build_ext that says which variant of kvflow._native it builds."""

    def build_extension(self, ext):
        variant = getattr(ext, "kvflow_variant", None)
        if variant:
            print(f"kvflow._native: {variant}", flush=True)
        super().build_extension(ext)


setup(packages=packages, package_dir=package_dir, ext_modules=[_native_extension()],
      cmdclass={"build_ext": BuildExt})
