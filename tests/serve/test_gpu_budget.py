"""Issue 14, kind 9: the memory budget of an instance. On CUDA it defaults to
--gpu-memory-utilization (0.9) of the GPU's free memory; on CPU a budget too small names the
flag to raise and the value that fits. Everything runs on the CPU: the device's free and total
memory are injected (``mem_info``)."""

from __future__ import annotations

import pytest
import torch

from kvflow.engine import MemoryBudgetError, determine_num_blocks
from kvflow.engine.profile import weight_bytes
from kvflow.model import PRESETS, LlamaForCausalLM, load_model
from kvflow.serve.__main__ import check_args, parse_args
from kvflow.serve.launch.budget import MIB, memory_budget, too_small_message
from kvflow.serve.launch.startup import StartupError, check_device

GIB = 1 << 30
H200 = (143_000 * MIB, 143_771 * MIB)  # (free, total) bytes of an idle H200
README_GPU = ["--device", "cuda", "--model", "kvflow-llama-32l", "--dtype", "bfloat16"]


def child_args(argv: list[str], role: str = "prefill"):
    """The config `--role all` hands its ``role`` child, read as that child reads it."""
    from kvflow.serve.launch.server import instance_config
    child = instance_config(parse_args(argv), role, "tcp://127.0.0.1:1")
    return parse_args(["--config-json", child.to_json()])


def test_readme_gpu_command_budget_covers_the_weights_on_an_h200():
    """The bug: `--device cuda --model kvflow-llama-32l --dtype bfloat16` gave each instance the
    CPU default of 512 MiB, below the model's 641 MiB of bf16 weights."""
    with torch.device("meta"):
        weights = weight_bytes(LlamaForCausalLM(PRESETS["kvflow-llama-32l"]).to(torch.bfloat16))
    assert weights == 672_278_656 > 512 * MIB  # 641.1 MiB
    child = child_args(README_GPU)
    assert (child.memory_budget_mb, child.gpu_memory_utilization) == (None, None)
    budget = memory_budget(child.device, child.memory_budget_mb, child.gpu_memory_utilization,
                           mem_info=H200)
    assert budget.bytes == int(0.9 * H200[0]) and budget.bytes - weights > 120 * GIB
    assert budget.describe() == ("125.7 GiB (--gpu-memory-utilization 0.9 of 139.6 GiB free on "
                                 "cuda, 140.4 GiB in all)")


def test_cpu_budget_is_the_flag_or_512_mib():
    assert memory_budget("cpu").bytes == 512 * MIB
    b = memory_budget("cpu", 64)
    assert (b.bytes, b.flag, b.value, b.free_bytes) == (64 * MIB, "--memory-budget-mb", 64, None)


def test_cuda_budget_is_a_fraction_of_free_memory_or_an_explicit_size():
    free, total = 40 * GIB, 80 * GIB
    assert memory_budget("cuda", mem_info=(free, total)).bytes == int(0.9 * free)
    half = memory_budget("cuda", gpu_memory_utilization=0.5, mem_info=(free, total))
    assert (half.bytes, half.flag, half.value) == (20 * GIB, "--gpu-memory-utilization", 0.5)
    assert memory_budget("cuda", 2048, mem_info=(free, total)).bytes == 2048 * MIB
    with pytest.raises(StartupError) as info:
        memory_budget("cuda", 50_000, mem_info=(free, total))
    assert str(info.value) == (
        "kvflow.serve: error: --memory-budget-mb 50000 is more than the 40960 MiB free on cuda "
        "(81920 MiB in all); lower it, or leave it out to take --gpu-memory-utilization "
        "(default 0.9) of the free memory")


def test_kv_blocks_are_what_the_fraction_leaves_after_weights_and_the_profile_run():
    """The profile run sizes the cache from the CUDA budget exactly as from a CPU one:
    (fraction x free - weights - peak activations) // bytes per block."""
    model, _ = load_model("kvflow-tiny")
    spec = model.kv_spec(16)
    # (the first run also holds one-time allocations, e.g. the RoPE table: warm up first)
    determine_num_blocks(model, spec, memory_budget_bytes=GIB, max_num_batched_tokens=128)
    with pytest.raises(MemoryBudgetError) as info:  # a run with no room left gives its parts
        determine_num_blocks(model, spec, memory_budget_bytes=weight_bytes(model),
                             max_num_batched_tokens=128)
    err = info.value
    budget = memory_budget("cuda", gpu_memory_utilization=0.5, mem_info=(64 * MIB, 80 * GIB))
    n = determine_num_blocks(model, spec, memory_budget_bytes=budget.bytes,
                             max_num_batched_tokens=128)
    assert err.weights == weight_bytes(model) and err.block_bytes == spec.bytes_per_block
    assert n == (32 * MIB - err.weights - err.peak) // spec.bytes_per_block > 0


@pytest.mark.parametrize("budget, parts, line", [
    (memory_budget("cpu", 1), dict(budget=MIB, weights=9 * MIB, peak=3 * MIB + 512 * 1024),
     "--memory-budget-mb 1 is too small for M: weights 9.0 MiB + peak activations 3.5 MiB at "
     "--max-num-batched-tokens 256 + one KV block 32.0 KiB = 12.5 MiB; raise --memory-budget-mb "
     "to at least 13"),
    (memory_budget("cuda", mem_info=(10 * GIB, 80 * GIB)),
     dict(budget=9 * GIB, weights=9 * GIB + 800 * MIB, peak=100 * MIB),
     "--gpu-memory-utilization 0.9 of the 10.0 GiB free on cuda (9.0 GiB) is too small for M: "
     "weights 9.8 GiB + peak activations 100.0 MiB at --max-num-batched-tokens 256 + one KV "
     "block 32.0 KiB = 9.9 GiB; raise --gpu-memory-utilization to at least 0.99"),
    (memory_budget("cuda", mem_info=(4 * GIB, 80 * GIB)),
     dict(budget=int(3.6 * GIB), weights=5 * GIB, peak=100 * MIB),
     "--gpu-memory-utilization 0.9 of the 4.0 GiB free on cuda (3.6 GiB) is too small for M: "
     "weights 5.0 GiB + peak activations 100.0 MiB at --max-num-batched-tokens 256 + one KV "
     "block 32.0 KiB = 5.1 GiB; only 4.0 GiB of 80.0 GiB is free on cuda: free GPU memory or "
     "lower --max-num-batched-tokens"),
    (memory_budget("cuda", mem_info=(4 * GIB, 80 * GIB)),
     dict(budget=int(3.6 * GIB), weights=GIB, peak=100 * MIB, free_after=16 * 1024),
     "cuda has 16.0 KiB free after the weights and the profile run of M, less than one KV block "
     "(32.0 KiB); free GPU memory or lower --max-num-batched-tokens"),
])
def test_too_small_budget_names_the_flag_and_the_value_that_fits(budget, parts, line):
    err = MemoryBudgetError("x", block_bytes=32 * 1024, tokens=256, **parts)
    assert too_small_message(budget, err, "M") == line


def test_p_and_d_on_one_gpu_each_get_half_the_fraction():
    assert child_args(README_GPU).gpu_memory_utilization is None            # GPU 0 and GPU 1
    for role in ("prefill", "decode"):
        assert child_args([*README_GPU, "--decode-device", "0"], role).gpu_memory_utilization == 0.45
    shared = [*README_GPU, "--decode-device", "0", "--gpu-memory-utilization", "0.8"]
    assert child_args(shared).gpu_memory_utilization == 0.4
    fixed = child_args([*README_GPU, "--decode-device", "0", "--memory-budget-mb", "4096"])
    assert (fixed.memory_budget_mb, fixed.gpu_memory_utilization) == (4096, None)


def test_one_gpu_with_the_default_decode_device_fails_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda", {"--prefill-device": 0, "--decode-device": 0})
    with pytest.raises(StartupError) as info:
        check_device("cuda", {"--prefill-device": 0, "--decode-device": 1})
    assert str(info.value) == (
        "kvflow.serve: error: --decode-device 1: this process sees 1 CUDA GPU(s) (ordinals 0..0); "
        "pass --decode-device 0 to put P and D on the one GPU (each then gets half of "
        "--gpu-memory-utilization)")


@pytest.mark.parametrize("argv, line", [
    (["--device", "cuda", "--gpu-memory-utilization", "1.5"],
     "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--device", "cuda", "--gpu-memory-utilization", "0.5", "--memory-budget-mb", "100"],
     "give --memory-budget-mb (100) or --gpu-memory-utilization (0.5), not both"),
])
def test_budget_flags_are_checked_together(argv, line):
    with pytest.raises(StartupError) as info:
        check_args(argv)
    assert str(info.value) == "kvflow.serve: error: " + line
