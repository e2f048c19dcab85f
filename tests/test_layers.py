"""Layers of the package (issue 27): the transport layer (``kvflow.connector.transport``) is
below the kinds and their contract; the vLLM connector stands on the connector's face
(``kvflow.connector``), the transport layer (``kvflow.connector.transport.*``) and the wire
codec (``kvflow.wire``), plus the modules below the connector (cache, layout, kernels,
segments, vllm_layout, shadow); never on a kind's module (``kvflow.connector.tcp``, ``ipc_push``, ...,
``base``) nor on serving's protocol (``kvflow.serve.protocol``).

Imports are read with ``ast`` as in :mod:`tests.test_import_graph` (every import in the file,
function-level ones included).
"""

from __future__ import annotations

from pathlib import Path

from tests.test_import_graph import REPO, ROOTS, imports, modules

# what kvflow/integrations/vllm may import: these modules and their submodules
VLLM_MAY_IMPORT = ("kvflow.integrations.vllm", "kvflow.connector.transport", "kvflow.wire",
                   "kvflow.cache", "kvflow.layout", "kvflow.kernels", "kvflow.segments",
                   "kvflow.vllm_layout", "kvflow.shadow")
VLLM_MAY_IMPORT_EXACTLY = ("kvflow.connector",)  # the face, not its other modules
# the transport layer is below the kinds: nothing of kvflow.connector outside it, no protocol
TRANSPORT_MAY_IMPORT = ("kvflow.connector.transport", "kvflow.cache", "kvflow.layout",
                        "kvflow.kernels", "kvflow.segments", "kvflow.scales")


def refused_imports(repo: Path = REPO, package: str = "kvflow.integrations.vllm",
                    may: tuple[str, ...] = VLLM_MAY_IMPORT,
                    exactly: tuple[str, ...] = VLLM_MAY_IMPORT_EXACTLY) -> list[str]:
    """``"module -> imported"`` for every import by a module of ``package`` of a kvflow module
    that is neither in ``exactly`` nor one of ``may`` or below it."""
    mods = modules(repo, ROOTS)
    known = set(mods)
    out = []
    for name, (path, is_pkg) in sorted(mods.items()):
        if name != package and not name.startswith(package + "."):
            continue
        for dep in sorted(imports(name, path, is_pkg, known)):
            if dep in exactly or any(dep == ok or dep.startswith(ok + ".") for ok in may):
                continue
            out.append(f"{name} -> {dep}")
    return out


def test_the_vllm_connector_imports_only_the_face_transport_and_wire():
    mods = modules(REPO, ROOTS)
    assert "kvflow.integrations.vllm.transfer" in mods  # the check reads the real package
    seen = imports("kvflow.integrations.vllm.transfer",
                   *mods["kvflow.integrations.vllm.transfer"], set(mods))
    assert "kvflow.connector.transport.frames" in seen and "kvflow.wire" in seen
    assert refused_imports() == []


def test_the_transport_layer_imports_no_kind_nor_the_contract():
    assert refused_imports(package="kvflow.connector.transport", may=TRANSPORT_MAY_IMPORT,
                           exactly=()) == []


def test_an_import_of_a_kind_module_or_the_protocol_is_named(tmp_path):
    files = {
        "kvflow/__init__.py": "",
        "kvflow/serve/__init__.py": "",
        "kvflow/serve/protocol.py": "",
        "kvflow/wire.py": "",
        "kvflow/connector/__init__.py": "",
        "kvflow/connector/base.py": "",
        "kvflow/connector/tcp.py": "",
        "kvflow/connector/ipc_push.py": "",
        "kvflow/connector/transport/__init__.py": "",
        "kvflow/connector/transport/shm.py": "",
        "kvflow/integrations/__init__.py": "",
        "kvflow/integrations/vllm/__init__.py": "from . import a\n",
        "kvflow/integrations/vllm/a.py": (
            "from kvflow.connector import TransferError\n"       # the face: allowed
            "from kvflow.connector.transport.shm import x\n"     # transport: allowed
            "from kvflow.wire import Codec\n"                    # the codec: allowed
            "from kvflow.connector.base import TransferError\n"  # a kind's contract: refused
            "def f():\n"
            "    from kvflow.connector import ipc_push\n"        # lazy, a kind: refused
            "    import kvflow.serve.protocol\n"),               # serving's wire: refused
        "kvflow/integrations/vllm/b.py": "from kvflow.connector.tcp import frame_tensor\n",
        "kernels/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert refused_imports(tmp_path) == [
        "kvflow.integrations.vllm.a -> kvflow.connector.base",
        "kvflow.integrations.vllm.a -> kvflow.connector.ipc_push",
        "kvflow.integrations.vllm.a -> kvflow.serve.protocol",
        "kvflow.integrations.vllm.b -> kvflow.connector.tcp",
    ]
