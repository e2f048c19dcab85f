"""The connector kinds registry (:mod:`kvflow.connector.kinds`): each entry agrees with its
module, the one option check refuses what the constructors refuse, a new kind reaches serve's
config, checks and pairing with no serve edit, and serve names no kind but through the
registry."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.connector import KINDS, Kind, Option, kinds, make_receiver, make_sender, register_kind
from kvflow.connector.tcp import TcpReceiver, TcpSender

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
SERVE = pathlib.Path(__file__).resolve().parents[2] / "kvflow" / "serve"


def _classes(kind: Kind):
    module = __import__(kind.module, fromlist=["_"])
    rx = [getattr(module, kind.receiver)] + ([getattr(module, kind.receiver_cuda)]
                                             if kind.receiver_cuda else [])
    return getattr(module, kind.sender), rx


@pytest.mark.parametrize("name", ["ipc-pull", "ipc-push", "tcp", "nixl"])
def test_each_entry_agrees_with_its_module(name):
    kind = KINDS[name]
    tx_cls, rx_classes = _classes(kind)
    assert tx_cls.name == name and {c.name for c in rx_classes} == {name}
    assert tx_cls(SPEC).layerwise_min_tokens == kind.layerwise_min_tokens  # no factory
    for rx in rx_classes:
        assert rx.reads_peer_memory == kind.reads_peer_memory, name
        assert rx.peer_writes == kind.writes_peer_memory, name
        assert rx.host_local == (not kind.cross_host), name
        assert ("verify" in dir(rx)) == kind.kv_verify, name
        assert ("head_start" in inspect.signature(rx).parameters) == kind.head_slices, name
    for opt in kind.options:  # each half takes its options, with the registry's default
        for cls, takes in ((tx_cls, opt.sender), *((c, opt.receiver) for c in rx_classes)):
            params = inspect.signature(cls).parameters
            assert (opt.name in params) == takes, (name, cls.__name__, opt.name)
            if takes:
                assert params[opt.name].default == opt.default, (name, cls.__name__, opt.name)


@pytest.mark.parametrize("name, key, good, bad", [
    ("ipc-push", "max_ctas", 1, 0),
    ("ipc-push", "layers_per_copy", 3, True),
    ("nixl", "write_timeout_s", 2.5, 0),
    ("nixl", "write_timeout_s", 1, -1.0),
    ("nixl", "mode", "staged", "bulk"),
    ("nixl", "layers_per_copy", 1, 0),
])
def test_the_check_and_the_constructor_agree(name, key, good, bad):
    """A value the registry takes, the kind's class takes; one it refuses, the class refuses."""
    assert kinds.check_options(name, {key: good}) == {key: good}
    tx_cls, _ = _classes(KINDS[name])
    tx = tx_cls(SPEC, **{key: good}) if KINDS[name].option(key).sender else None
    assert tx is None or getattr(tx, {"write_timeout_s": "timeout_s"}.get(key, key)) == good
    with pytest.raises(ValueError) as e:
        kinds.check_options(name, {key: bad})
    assert str(e.value) == (f"kv_connector_config key {key!r} of connector {name!r} must be "
                            f"{KINDS[name].option(key).rule}; got {bad!r}")
    with pytest.raises(ValueError):
        tx_cls(SPEC, **{key: bad})


def test_option_rules_and_the_generated_text():
    assert [o.rule for o in KINDS["nixl"].options] == [
        "one of direct, staged", "an int >= 1", "an int >= 1", "a number of seconds > 0",
        "an int >= 1"]
    assert KINDS["nixl"].option("write_timeout_s").describe().startswith(
        "write_timeout_s (a number of seconds > 0, default 30): P waits this long")
    assert kinds.layerwise_defaults() == "16384 (ipc-pull, ipc-push, tcp), 0 (nixl)"
    assert kinds.with_capability("reblocks") == ("ipc-pull", "ipc-push", "tcp")
    assert kinds.with_capability("block_scales") == ("ipc-pull", "ipc-push")
    assert kinds.resolve("auto", "cuda:1").name == "ipc-push"
    with pytest.raises(ValueError) as e:
        register_kind(Kind("auto", "m", "S", "R", "s", "p", "d"))
    assert str(e.value) == ("connector kind 'auto': the name must be non-empty and not 'auto', "
                            "the option names distinct; got options []")


# ---- a new kind: its module (here: this file), its entry, its tests; no serve edit -------------
class FakeSender(TcpSender):
    """tcp with one more option, under another name."""

    name = "tcp-fake"

    def __init__(self, spec, device="cpu", *, frames: int = 2, **kw) -> None:
        super().__init__(spec, device, **kw)
        self.frames = frames


class FakeReceiver(TcpReceiver):
    name = "tcp-fake"


FAKE = Kind("tcp-fake", __name__, "FakeSender", "FakeReceiver",
            summary="tcp under another name, for tests", p_half="as tcp", d_half="as tcp",
            options=(Option("frames", int, 2, "frames per layer", minimum=1),),
            reblocks=True, block_scales=False, head_slices=True, layerwise_min_tokens=64,
            cross_host=True, kv_verify=True)


@pytest.fixture
def fake_kind():
    register_kind(FAKE)
    yield FAKE
    del KINDS[FAKE.name]


def test_a_registered_kind_is_built_by_the_factory(fake_kind):
    tx = make_sender("tcp-fake", SPEC, config={"frames": 3})
    rx = make_receiver("tcp-fake", SPEC, head_start=0)
    assert (type(tx), type(rx), tx.frames, tx.layerwise_min_tokens) == (FakeSender, FakeReceiver,
                                                                        3, 64)
    from kvflow.connector import CONNECTORS
    assert CONNECTORS == ("ipc-pull", "ipc-push", "tcp", "nixl", "tcp-fake")


def test_a_key_for_a_kind_of_no_options_says_it_takes_none():
    bare = register_kind(Kind("tcp-bare", __name__, "FakeSender", "FakeReceiver", "s", "p", "d"))
    try:
        with pytest.raises(ValueError) as e:
            kinds.check_options("tcp-bare", {"frames": 2})
        assert str(e.value) == ("kv_connector_config key 'frames' is not an option of connector "
                                "'tcp-bare' (it takes none)")
    finally:
        del KINDS[bare.name]


def test_serve_config_checks_and_pairing_take_a_new_kind(fake_kind):
    from kvflow.serve.__main__ import build_parser, check_args, parse_args
    from kvflow.serve.instance.pairing import check_pairing
    from kvflow.serve.launch.startup import StartupError

    cfg = parse_args(["--kv-connector", "tcp-fake", "--kv-connector-config", '{"frames": 4}',
                      "--kv-verify", "--max-model-len", "32", "--layerwise-min-tokens", "64"])
    assert (cfg.kv_connector, cfg.kv_connector_config) == ("tcp-fake", {"frames": 4})
    with pytest.raises(StartupError) as e:
        check_args(["--kv-connector", "tcp-fake", "--kv-connector-config", '{"frames": 0}'])
    assert str(e.value) == ("kvflow.serve: error: --kv-connector-config key 'frames' of "
                            "connector 'tcp-fake' must be an int >= 1; got 0")
    with pytest.raises(StartupError) as e:  # its own layerwise default, 64 <= --max-model-len
        check_args(["--kv-connector", "tcp-fake", "--kv-verify", "--max-model-len", "128"])
    assert "prompts from --layerwise-min-tokens 64 tokens (<= --max-model-len 128)" in str(e.value)
    # argparse wraps at spaces and after hyphens: undo both
    text = " ".join(build_parser().format_help().replace("-\n", "-").split()).replace("- ", "-")
    assert "tcp-fake (tcp under another name, for tests)" in text
    assert "tcp-fake: frames (an int >= 1, default 2): frames per layer" in text
    other = SPEC.with_(block_size=8).to_dict()
    assert check_pairing(SPEC, "p-1", other, "d-2", "tcp-fake", "decode") == ""
    assert check_pairing(SPEC, "p-1", other, "d-2", "nixl").endswith(
        "(re-blocking connectors: ipc-pull, ipc-push, tcp, tcp-fake)")
    fp8 = SPEC.with_(dtype=torch.float8_e4m3fn).to_dict()  # no reblocks_fp8: like tcp
    assert "the tcp-fake connector does not carry the fp8 scales of P (d-2)" in check_pairing(
        SPEC, "p-1", fp8, "d-2", "tcp-fake", "decode")


# ---- serve names no kind but through the registry --------------------------------------------
_KIND = re.compile(r"(?<![\w-])(ipc-pull|ipc-push|tcp|nixl)(?![\w-]|://)")


def kind_literals(path: pathlib.Path) -> list[str]:
    """``file:line: kind`` of each kind name in a string literal of ``path``'s code (not its
    docstrings or comments; ``tcp://`` is an address scheme, not the kind)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [f"{path.name}:{n.lineno}: {m.group(1)}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            for m in _KIND.finditer(n.value)]


def test_kind_literals_are_found(tmp_path):
    path = tmp_path / "case.py"
    path.write_text('"""ipc-pull in a docstring."""\nX = ("tcp", "tcp://h:1", "nixl-ish")\n'
                    'def f():\n    """tcp"""\n    return f"the ipc-push {1}"  # nixl\n')
    assert kind_literals(path) == ["case.py:2: tcp", "case.py:5: ipc-push"]


def test_the_registry_users_of_serve_name_no_kind():
    assert [hit for name in ("launch/config.py", "launch/checks.py", "instance/pairing.py")
            for hit in kind_literals(SERVE / name)] == []


def test_serve_names_no_kind_but_through_the_registry():
    assert [hit for path in sorted(SERVE.rglob("*.py")) for hit in kind_literals(path)] == []
