"""Build glue: package discovery for the two source roots (``kvflow/`` and ``kernels/``, the
latter imported as ``kvflow.kernels``), and the native extension ``kvflow._native`` (``xpu/``).
Metadata lives in pyproject.toml.

``kvflow._native`` is always built with its host backend (C++17, pybind11, no SDK); with
``KVFLOW_XPU_SDK`` set, the Kunlun XPU variant too (see ``xpu/build.py``). The build log says
which: ``kvflow._native: host backend (no KVFLOW_XPU_SDK)``.
"""

import importlib.util
import os

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

packages = ["kvflow"] + [f"kvflow.{p}" for p in find_packages("kvflow")]
packages += ["kvflow.kernels"] + [f"kvflow.kernels.{p}" for p in find_packages("kernels")]
package_dir = {"kvflow": "kvflow", "kvflow.kernels": "kernels"}


def _native_extension():
    from pybind11.setup_helpers import Pybind11Extension

    root = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("kvflow_xpu_build", os.path.join(root, "xpu", "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    sources, kwargs, variant = build.extension_kwargs(root=root)
    # optional: without a C++ compiler the rest of kvflow still installs, and
    # kvflow.kernels.available_backends()["native"] says why the extension is missing.
    ext = Pybind11Extension("kvflow._native", sources, optional=True, **kwargs)
    ext.kvflow_variant = variant
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
