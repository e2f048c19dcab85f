"""Tests of kvflow/bench/."""
