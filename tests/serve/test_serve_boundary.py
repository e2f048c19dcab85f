"""The connector boundary (issue 27): serve runs the control plane only. It names no data-plane
message (the connector's wire between P and D: ``KVReady``, ``KVData``, ``KVLayer``,
``KVPushed``, ``KVAck``, ``LeaseRenew``) and imports from :mod:`kvflow.connector` only its face
(``kvflow.connector`` and ``kvflow.connector.kinds``); D hands every data-plane message to its
receiver through the loop's one ``on_data`` handler. Read from the source with :mod:`ast`, so a
docstring or comment that mentions a message is no offence, a name in code is.
"""

from __future__ import annotations

import ast
from pathlib import Path


SERVE = Path(__file__).resolve().parents[2] / "kvflow" / "serve"
DATA_MESSAGES = ("KVReady", "KVData", "KVLayer", "KVPushed", "KVAck", "LeaseRenew")
FACE = ("kvflow.connector", "kvflow.connector.kinds")


def data_message_names(source: str, filename: str) -> list[str]:
    """``filename:line: name`` for each place in ``source`` whose code names a data-plane
    message (a name, an attribute, an imported name)."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name.rsplit(".", 1)[-1] in DATA_MESSAGES:
                    hits.append(f"{filename}:{node.lineno}: {alias.name}")
            continue
        else:
            continue
        if name in DATA_MESSAGES:
            hits.append(f"{filename}:{node.lineno}: {name}")
    return sorted(set(hits), key=lambda h: (h.split(":")[0], int(h.split(":")[1]), h))


def connector_imports(source: str, filename: str) -> list[str]:
    """``filename:line: module`` for each import of a module under ``kvflow.connector`` that is
    not its face (a relative import inside serve stays in serve)."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "kvflow.connector":  # from kvflow.connector import base
                modules += [f"kvflow.connector.{a.name}" for a in node.names
                            if a.name in _CONNECTOR_MODULES]
        else:
            continue
        for module in modules:
            if (module == "kvflow.connector" or module.startswith("kvflow.connector.")) \
                    and module not in FACE:
                hits.append(f"{filename}:{node.lineno}: {module}")
    return hits


_CONNECTOR_MODULES = {p.stem for p in (SERVE.parent / "connector").iterdir()
                      if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())} \
    - {"__init__", "kinds"}


def _serve_files():
    files = sorted(SERVE.rglob("*.py"))
    assert len(files) > 20, files  # the package is found, not an empty glob
    return files


def _offences(find, files) -> list[str]:
    root = SERVE.parents[1]
    return [hit for p in files for hit in find(p.read_text(), str(p.relative_to(root)))]


def test_serve_names_no_data_plane_message():
    assert _offences(data_message_names, _serve_files()) == []


def test_prefill_names_no_data_plane_message():
    """P hands D's acks and renewals to its connector (:mod:`kvflow.connector.held`)."""
    assert _offences(data_message_names, [SERVE / "instance" / "prefill.py"]) == []


def test_serve_imports_only_the_connector_face():
    assert _offences(connector_imports, _serve_files()) == []


def test_the_checks_name_each_offence_by_file_and_line():
    source = ('"""KVAck in a docstring is no offence."""\n'
              "from kvflow.serve.protocol import Abort, KVAck\n"
              "import kvflow.connector.lent\n"
              "from kvflow.connector import Peer, kinds, lent\n"
              "from kvflow.connector.arrival import Arrival\n"
              "from .pairing import check_peer\n"
              "def f(msg, protocol):\n"
              "    # LeaseRenew in a comment: no offence\n"
              "    return isinstance(msg, protocol.KVPushed) or KVReady\n")
    assert data_message_names(source, "x.py") == [
        "x.py:2: KVAck", "x.py:9: KVPushed", "x.py:9: KVReady"]
    assert connector_imports(source, "x.py") == [
        "x.py:3: kvflow.connector.lent", "x.py:4: kvflow.connector.lent",
        "x.py:5: kvflow.connector.arrival"]


def test_the_loop_hands_every_data_plane_message_to_on_data():
    import zmq

    from kvflow.connector import is_data_message
    from kvflow.connector.messages import KVAck, KVPushed, LeaseRenew
    from kvflow.serve.protocol import Abort, encode
    from kvflow.serve.instance.loop import EventLoop

    class Sock:
        type = zmq.DEALER

    class Loop(EventLoop):
        instance_id = "d-test"

        def __init__(self):
            super().__init__()
            self.got = []

        def on_data(self, msg, frames, ident):
            self.got.append(("data", type(msg).__name__, frames))

        def on_abort(self, msg, frames, ident):
            self.got.append(("abort", msg.req_id, frames))

    loop, sock = Loop(), Sock()
    loop.sockets[sock] = "test link"
    for msg in (KVPushed(req_id="a", ok=True), KVAck(req_id="b", ok=True),
                LeaseRenew(req_ids=["c"]), Abort(req_id="d")):
        loop.dispatch(sock, [encode(msg), b"payload"])
    assert loop.got == [("data", "KVPushed", [b"payload"]), ("data", "KVAck", [b"payload"]),
                        ("data", "LeaseRenew", [b"payload"]), ("abort", "d", [b"payload"])]
    assert is_data_message(KVAck(req_id="b", ok=True)) and not is_data_message(Abort(req_id="d"))


def test_a_loop_without_its_own_on_data_uses_the_message_handler():
    """The base ``on_data`` calls ``on_<type>`` (P and D both give their own now)."""
    from kvflow.connector.messages import KVAck
    from kvflow.serve.instance.loop import EventLoop

    got = []

    class Loop(EventLoop):
        instance_id = "p-test"

        def on_kvack(self, msg, frames, ident):
            got.append((msg.req_id, frames, ident))

    Loop().on_data(KVAck(req_id="r", ok=True), [b"x"], b"d-1")
    assert got == [("r", [b"x"], b"d-1")]
