"""The connector package's factory and contract: names, ``auto``, per-connector options, and
that serving code reaches connectors only through :mod:`kvflow.connector`."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.connector import (CONNECTORS, KVReceiver, KVSender, check_options, make_receiver,
                              make_sender, resolve_connector)

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
SERVE = pathlib.Path(__file__).resolve().parents[2] / "kvflow" / "serve"


def test_factory_names_and_auto():
    assert CONNECTORS == ("ipc-pull", "ipc-push", "tcp", "nixl")
    assert resolve_connector("auto", "cpu") == "ipc-pull"
    assert resolve_connector("auto", "cuda") == resolve_connector("auto", "cuda:1") == "ipc-push"
    for name in CONNECTORS:
        assert resolve_connector(name, "cuda") == resolve_connector(name, "cpu") == name
        tx, rx = make_sender(name, SPEC), make_receiver(name, SPEC)
        assert isinstance(tx, KVSender) and isinstance(rx, KVReceiver)
        assert tx.name == rx.name == name
    assert make_sender("auto", SPEC).name == make_receiver("auto", SPEC).name == "ipc-pull"
    with pytest.raises(ValueError) as e:
        make_sender("rdma", SPEC)
    assert str(e.value) == ("kv_connector must be 'auto' or one of ipc-pull, ipc-push, tcp, nixl; "
                            "got 'rdma'")


def test_layerwise_threshold_defaults_and_the_max_model_len_cutoff():
    assert make_sender("ipc-push", SPEC).layerwise_min_tokens == 16384
    assert make_sender("ipc-pull", SPEC).layerwise_min_tokens == 16384
    assert make_sender("tcp", SPEC).layerwise_min_tokens == 16384
    tx = make_sender("tcp", SPEC, layerwise_min_tokens=100, max_model_len=2048)
    assert tx.layerwise_enabled and tx.goes_layerwise(100) and not tx.goes_layerwise(99)
    off = make_sender("tcp", SPEC, max_model_len=2048)  # 16384 > 2048: never layerwise
    assert not off.layerwise_enabled and not off.goes_layerwise(2048)


def test_connector_config_keys():
    tx = make_sender("ipc-push", SPEC, config={"layers_per_copy": 2, "max_ctas": 8})
    assert (tx.layers_per_copy, tx.max_ctas) == (2, 8)
    assert check_options("ipc-push", None) == {}
    with pytest.raises(ValueError) as e:
        make_sender("ipc-push", SPEC, config={"layers_per_copy": 2, "max_cta": 8})
    assert str(e.value) == ("kv_connector_config key 'max_cta' is not an option of connector "
                            "'ipc-push' (it takes layers_per_copy, max_ctas)")
    with pytest.raises(ValueError) as e:  # P's max_ctas is ipc-push's; tcp's cap is D's
        make_sender("tcp", SPEC, config={"max_ctas": 8})
    assert str(e.value) == ("kv_connector_config key 'max_ctas' is not an option of connector "
                            "'tcp' (it takes receive_max_ctas)")
    with pytest.raises(ValueError) as e:  # auto on CPU is ipc-pull
        make_sender("auto", SPEC, config={"max_ctas": 8})
    assert str(e.value) == ("kv_connector_config key 'max_ctas' is not an option of connector "
                            "'ipc-pull' (it takes receive_max_ctas)")


def test_receive_max_ctas_reaches_d_and_not_p():
    """D's receive copies take the cap (default 16, from the interference study); P's half of
    the same config ignores it; a bad value is refused naming key and value."""
    for kind in ("ipc-pull", "tcp", "nixl"):
        assert make_receiver(kind, SPEC).receive_max_ctas == 16
        assert make_receiver(kind, SPEC, config={"receive_max_ctas": 4}).receive_max_ctas == 4
        assert not hasattr(make_sender(kind, SPEC, config={"receive_max_ctas": 4}),
                           "receive_max_ctas")
    with pytest.raises(ValueError, match=r"receive_max_ctas.*0"):
        make_receiver("tcp", SPEC, config={"receive_max_ctas": 0})


def test_serve_imports_no_concrete_connector():
    """kvflow/serve reaches connectors through ``kvflow.connector`` only (the factory and its
    registry, ``kvflow.connector.kinds``)."""
    pkg = SERVE.parent / "connector"
    kinds = ({p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "kinds")}
             | {"layerwise", "transport"})
    assert {"ipc_pull", "ipc_push", "tcp"} <= kinds and (pkg / "transport" / "shm.py").is_file()
    bad = []
    for path in sorted(SERVE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
                if node.module == "kvflow.connector":  # from kvflow.connector import tcp
                    names += [f"kvflow.connector.{a.name}" for a in node.names if a.name in kinds]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [f"{path.name}: {n}" for n in names
                    if n.startswith(("kvflow.connector.", "kvflow.transfer", "kvflow.layerwise"))
                    and n != "kvflow.connector.kinds"]
    assert bad == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", [k for k in CONNECTORS if k != "nixl"])  # nixl: CPU caches
def test_cuda_without_an_index_is_the_current_gpu(kind):
    """``--device cuda`` names the current GPU: both halves hold ``cuda:N``, so P and D on one
    GPU compare equal (a bare ``cuda`` against ``cuda:0`` once refused the push pairing)."""
    want = torch.device("cuda", torch.cuda.current_device())
    assert make_sender(kind, SPEC, "cuda").device == want
    assert make_receiver(kind, SPEC, "cuda").device == want
