"""tcp and nixl move block bytes only, so they refuse an fp8 spec with per-block scales
(``scales="block_head"``) at construction and at pairing, naming the connector and the field,
instead of leaving D's scales behind (issue #19); ipc-pull / ipc-push and per-tensor fp8 pair."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.connector import make_receiver, make_sender
from kvflow.serve.pairing import check_pairing

FP32 = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                   dtype=torch.float32, layout="NHD")
BH = FP32.with_(dtype=torch.float8_e4m3fn, scales="block_head")
FP8 = FP32.with_(dtype=torch.float8_e4m3fn)  # per-tensor scales


def why(kind: str, who: str) -> str:
    return (f"scales='block_head' ({who}): the {kind} connector moves block bytes only, not an "
            f"fp8 cache's per-block scales; use ipc-pull or ipc-push, or scales='tensor'")


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_pairing_refuses_block_head_for_bytes_only_connectors(kind):
    assert check_pairing(BH, "p-1", BH.to_dict(), "d-2", kind) == \
        "pairing refused: " + why(kind, "p-1")
    assert check_pairing(FP32, "p-1", BH.with_(block_size=8).to_dict(), "d-2", kind) == \
        "pairing refused: " + why(kind, "d-2")
    assert check_pairing(FP8, "p-1", FP8.to_dict(), "d-2", kind) == ""


@pytest.mark.parametrize("kind", ["ipc-pull", "ipc-push"])
def test_pairing_takes_block_head_over_ipc(kind):
    assert check_pairing(BH, "p-1", BH.to_dict(), "d-2", kind) == ""
    assert check_pairing(FP32, "p-1", BH.with_(block_size=8).to_dict(), "d-2", kind) == ""


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
@pytest.mark.parametrize("make", [make_sender, make_receiver])
def test_constructors_refuse_block_head(kind, make):
    with pytest.raises(ValueError) as e:
        make(kind, BH)
    assert str(e.value) == why(kind, "spec")


def test_tcp_takes_per_tensor_fp8_and_ipc_takes_block_head():
    make_sender("tcp", FP8).close()
    make_receiver("tcp", FP8).close()
    make_receiver("ipc-pull", BH).close()
