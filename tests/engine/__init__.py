"""Tests of kvflow/engine/."""
