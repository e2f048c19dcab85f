"""Shared-memory names for the transfer package: thin aliases of :mod:`kvflow.segments`, which
owns every segment's name, creation, owner judgement and clean-up (no torch import: the router
uses it)."""

from __future__ import annotations

from kvflow.segments import SHM_DIR, clean_stale, segment_path, unlink

__all__ = ["SHM_DIR", "shm_path", "clean_stale_segments", "unlink_segment"]

shm_path = segment_path
clean_stale_segments = clean_stale
unlink_segment = unlink
