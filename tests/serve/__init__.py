"""Tests of kvflow/serve/."""
