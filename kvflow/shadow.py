"""The repository's top-level ``kernels/`` (installed as ``kvflow.kernels``) against the PyPI
package ``kernels`` (Hugging Face's, which transformers >= 5.25 requires and imports as
``kernels``).

When the repository root is on ``sys.path`` (``python -m pytest`` or ``python -m kvflow...`` run
from it), ``import kernels`` finds the repository's folder instead of the installed package and
``import transformers`` fails ("cannot import name 'CUDAProperties' from 'kernels'").
:func:`unshadow_kernels` imports the installed package as ``kernels`` first; call it before
importing transformers. kvflow itself never imports the top-level name ``kernels``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root (of an editable install)


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == ROOT
    except OSError:
        return False


def unshadow_kernels() -> None:
    """Make ``import kernels`` give the installed package, not the repository's ``kernels/``
    (a no-op when nothing shadows it or no such package is installed)."""
    ours = ROOT / "kernels" / "__init__.py"
    mod = sys.modules.get("kernels")
    if mod is not None and getattr(mod, "__file__", None) != str(ours):
        return  # the installed package is imported already
    if not ours.exists():
        return  # not a source checkout: nothing can shadow it
    saved = sys.path[:]
    shadow = sys.modules.pop("kernels", None)
    sys.path[:] = [p for p in sys.path if not _is_root(p)]
    importlib.invalidate_caches()
    try:
        importlib.import_module("kernels")
    except ImportError:  # not installed: leave things as they were
        if shadow is not None:
            sys.modules["kernels"] = shadow
    finally:
        sys.path[:] = saved
