"""The launch-sweep rounds (``python -m kvflow.bench sweep``) and the defaults they chose."""

import dataclasses

import pytest

pytest.importorskip("triton")

from kvflow.bench import sweep as _sweep_module  # noqa: E402
from kvflow.kernels.triton import copy_runs as cr  # noqa: E402


def _sweep():
    return _sweep_module


def test_every_round_builds_distinct_named_configs():
    sweep = _sweep()
    for rnd in sweep.ROUNDS:
        names = [name for name, _ in sweep.variants(rnd)]
        assert len(names) == len(set(names)), (rnd, names)
        assert all(isinstance(cfg, cr.LaunchConfig) for _, cfg in sweep.variants(rnd))


def test_round_one_default_is_the_old_persistent_4_warp_launch():
    cfg = dict(_sweep().variants("1"))["default"]
    assert (cfg.persistent, cfg.num_warps, cfg.copy_block_bytes) == (True, 4, 16384)


def test_defaults_are_the_variant_round_3_measured_best():
    # LaunchConfig's docstring quotes this variant's figures; change both together
    chosen = dict(_sweep().variants("3"))["np 16w cs64K"]
    assert dataclasses.asdict(chosen) == dataclasses.asdict(cr.LaunchConfig())
