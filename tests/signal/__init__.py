"""Tests of kvflow/signal/."""
