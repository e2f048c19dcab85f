"""Tests of kvflow/blocks/."""
