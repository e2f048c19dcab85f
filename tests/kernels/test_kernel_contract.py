"""Every registered backend meets :mod:`kvflow.kernels.contract`; a backend that does not is
told what it lacks."""

from __future__ import annotations

import pytest

from kvflow.kernels import contract, reference_reblock
from kvflow.kernels.contract import Backend, Reblocker, contract_problems
from kvflow.kernels.registry import _BACKENDS, _load, backend_names

# What each backend that loads here declares (devices aside: they depend on the environment).
CAPABILITIES = {
    "torch": (False, False, ("pull",), True),
    "numba": (False, True, ("pull",), True),
    "native": (False, False, ("pull",), False),
    "xpu": (False, False, ("pull",), False),
    "triton": (True, True, ("pull", "push"), True),
    "numba_cuda": (False, False, ("pull", "push"), False),
    "copy_engine": (False, False, ("pull", "push"), False),
}


@pytest.mark.parametrize("name", backend_names())
def test_each_registered_backend_meets_the_contract(name):
    be = _load(name)
    if be is None:
        pytest.skip(f"backend {name!r} does not import here")
    assert be.name == name and _BACKENDS[name] is be
    assert contract_problems(be) == []
    assert isinstance(be, Backend)
    caps = (getattr(be, "device_checks", False), getattr(be, "digests", False),
            tuple(getattr(be, "directions", ("pull",))), isinstance(be, Reblocker))
    assert caps == CAPABILITIES[name]


def test_the_torch_and_numba_backends_load_here():
    assert {"torch", "numba", "native"} <= {n for n in backend_names() if _load(n) is not None}


class _Partial:
    name = "partial"
    devices = ["cpu"]
    digests = True

    def unavailable_reason(self):
        return None

    def gather(self, cache, ids, out, start, stop, max_ctas=None):
        pass

    def scatter(self, src, cache, ids, start, stop, max_ctas=None, digest=None):
        pass

    def reblock(self, job):
        pass


def test_a_backend_that_misses_the_contract_is_told_what_it_lacks():
    problems = contract_problems(_Partial())
    assert problems[0] == "devices must be a set of device types, got ['cpu']"
    assert problems[1:] == [
        "gather() cannot be called with 6 positional arguments and digest=: got an unexpected "
        "keyword argument 'digest'",
        "no method copy()",
        "reblock() cannot be called with 2 positional arguments and check=: too many positional "
        "arguments"]
    assert not isinstance(_Partial(), Backend)  # no copy()


def test_job_and_operand_are_defined_once():
    assert reference_reblock.Job is contract.Job and reference_reblock.Operand is contract.Operand
    assert contract.Job.__module__ == "kvflow.kernels.contract"
