"""Triton GPU backend (see issue: Triton kernels)."""
