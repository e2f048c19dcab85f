"""Tests of kvflow/kernels/."""
