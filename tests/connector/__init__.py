"""Tests of kvflow/connector/."""
