"""tcp and nixl move block bytes only, so they refuse an fp8 spec with per-block scales
(``scales="block_head"``) at construction and at pairing, naming the connector and the field,
instead of leaving D's scales behind (issue #19); ipc-pull / ipc-push and per-tensor fp8 pair."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.connector import make_receiver, make_sender
from kvflow.serve.instance.pairing import check_pairing

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


@pytest.mark.parametrize("my_role, p_id", [("prefill", "p-1"), ("decode", "d-2")])
def test_tcp_refuses_an_fp8_p_with_a_d_of_another_spec(my_role, p_id):
    """An fp8 P (per-tensor scales) and a D of another spec over tcp: D's re-blocked scatter
    would need P's scales, which tcp does not send. Refused from either side; an fp32 P into an
    fp8 D, and equal fp8 specs, still pair; ipc-pull maps D's fp8 the other way round."""
    p = FP8 if my_role == "prefill" else FP32
    other = FP32 if my_role == "prefill" else FP8
    me, peer = ("p-1", "d-2") if my_role == "prefill" else ("d-2", "p-1")
    mine_name = "float8_e4m3fn" if my_role == "prefill" else "float32"
    theirs_name = "float32" if my_role == "prefill" else "float8_e4m3fn"
    assert check_pairing(p, me, other.to_dict(), peer, "tcp", my_role) == (
        f"KV cache spec mismatch, pairing refused: dtype: torch.{mine_name} ({me}) vs "
        f"torch.{theirs_name} ({peer}); the tcp connector does not carry the fp8 scales of P "
        f"(p-1) that a D of another spec needs; use ipc-pull or ipc-push, or equal specs")
    assert check_pairing(p, me, other.to_dict(), peer, "ipc-pull", my_role) == ""
    # fp32 P -> fp8 D over tcp: D quantizes with its own scales
    fp32_p = (FP32, FP8) if my_role == "prefill" else (FP8, FP32)
    assert check_pairing(fp32_p[0], me, fp32_p[1].to_dict(), peer, "tcp", my_role) == ""
    assert check_pairing(FP8, me, FP8.to_dict(), peer, "tcp", my_role) == ""


def test_mla_pairs_with_mla_of_another_block_size_but_not_with_nhd():
    """The kernels map MLA to MLA (block_size, dtype); MLA to NHD is refused."""
    mla = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=16, block_size=16,
                      dtype=torch.float32, layout="MLA")
    assert check_pairing(mla, "p-1", mla.with_(block_size=64).to_dict(), "d-2", "tcp") == ""
    nhd = mla.with_(layout="NHD")
    assert check_pairing(mla, "p-1", nhd.to_dict(), "d-2", "tcp") == (
        "KV cache spec mismatch, pairing refused: layout: MLA (p-1) vs NHD (d-2); P and D may "
        "differ only in block_size, layout (NHD/HND) and dtype")
