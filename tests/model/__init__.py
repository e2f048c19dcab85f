"""Tests of kvflow/model/."""
