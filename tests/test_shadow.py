"""kvflow.shadow: the repository's kernels/ must not hide the PyPI package ``kernels`` that
transformers (>= 5.25) imports, when the repository root is on sys.path."""

import importlib.util
import json
import subprocess
import sys

import pytest

from kvflow.shadow import ROOT

_CHILD = """
import json, kernels as before
from kvflow.shadow import unshadow_kernels
unshadow_kernels()
import kernels, kvflow.kernels
print(json.dumps({"before": before.__file__, "after": kernels.__file__,
                  "ours": kvflow.kernels.__file__}))
"""


def _installed_kernels() -> bool:
    """Whether a ``kernels`` package other than the repository's is installed."""
    from kvflow.shadow import _is_root
    paths = [p for p in sys.path if not _is_root(p)]
    spec = importlib.machinery.PathFinder.find_spec("kernels", paths)
    return spec is not None


@pytest.mark.skipif(not _installed_kernels(), reason="no PyPI kernels package installed "
                    "(transformers >= 5.25 brings it)")
def test_installed_kernels_package_wins_over_the_repository_folder():
    # run from the repository root with it first on sys.path, as `python -m pytest` does
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == str(ROOT / "kernels" / "__init__.py")  # shadowed at first
    assert got["after"] != got["before"]  # the installed one after the call
    assert importlib.util.find_spec("kernels").origin == got["after"]  # as conftest made it
    assert got["ours"] == str(ROOT / "kernels" / "__init__.py")  # kvflow.kernels unchanged


def test_unshadow_is_a_no_op_without_an_installed_package(monkeypatch):
    # nothing installed to find: the repository's folder stays what `kernels` imports
    monkeypatch.setattr(sys, "path", [str(ROOT)])
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    from kvflow.shadow import unshadow_kernels
    unshadow_kernels()
    assert "kernels" not in sys.modules
