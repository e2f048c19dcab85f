"""Build glue: package discovery for the two source roots (``kvflow/`` and ``kernels/``, the
latter imported as ``kvflow.kernels``). Metadata lives in pyproject.toml."""

from setuptools import find_packages, setup

packages = ["kvflow"] + [f"kvflow.{p}" for p in find_packages("kvflow")]
packages += ["kvflow.kernels"] + [f"kvflow.kernels.{p}" for p in find_packages("kernels")]
package_dir = {"kvflow": "kvflow", "kvflow.kernels": "kernels"}

setup(packages=packages, package_dir=package_dir)
