"""A study's row sink: each row saved to ``<result>.partial.jsonl`` as it is measured, and one
progress line per row on stderr (see :mod:`kvflow.bench.record` for the run around it).

:class:`RowSink` is the row list :func:`kvflow.bench.record.rows` hands a study; :func:`describe`
writes a row as one progress line; :func:`say` prints a line above a tqdm bar.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any


def partial_path(path: Path) -> Path:
    """``x.json`` -> ``x.partial.jsonl`` (the rows of a run still going, or killed)."""
    return path.with_suffix(".partial.jsonl")


class RowSink(list):
    """The row list of a study run by :func:`run_study`: every ``append``/``extend``/``+=``
    writes the new rows to the ``.partial.jsonl`` at once (flushed) and prints a progress line;
    once a signal came it saves no more rows (it raises :class:`Interrupted` instead)."""

    def __init__(self, path: Path, header: dict[str, Any], study: str, quiet: bool,
                 check=None) -> None:
        super().__init__()
        self.check = check  # called before and after each row: raises Interrupted after a signal
        self.path, self.header, self.study, self.quiet = Path(path), header, study, quiet
        self.lock = threading.RLock()
        self.done = False  # the result file is written (complete or interrupted)
        self.interrupted: str | None = None
        self.t0 = time.perf_counter()
        self._file = None

    def append(self, row: dict) -> None:
        self.extend([row])

    def __iadd__(self, rows):
        self.extend(rows)
        return self

    def extend(self, rows) -> None:
        rows = list(rows)
        if self.check is not None:
            self.check()  # a row measured after the signal is not saved (the study stops)
        with self.lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(partial_path(self.path), "w")
                self._file.write(json.dumps(dict(self.header, complete=False)) + "\n")
                self._say(f"{self.study}: rows are saved as measured to {partial_path(self.path)}")
            for row in rows:
                super().append(row)
                self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        for row in rows:
            self._say(f"{self.study}: row {len(self)}: {describe(row)} "
                      f"({time.perf_counter() - self.t0:.1f} s)")
        if self.check is not None:
            self.check()

    def settle(self, rows) -> None:
        """Make ``rows`` the study's rows for the result file (e.g. rows pooled over repeated
        server starts, from the rows saved as measured); the ``.partial.jsonl`` keeps the rows
        as they were measured. Nothing is printed."""
        rows = list(rows)
        with self.lock:
            self[:] = rows

    def _say(self, line: str) -> None:
        if not self.quiet:
            say(line)

    def write(self, env: dict[str, Any], interrupted: str | None = None) -> Path:
        """Write the result file with the rows so far (once; later calls return its path) and
        remove the ``.partial.jsonl``."""
        from .schema import write_results
        with self.lock:
            if not self.done:
                write_results(self.path, env, list(self), interrupted=interrupted)
                self.done, self.interrupted = True, interrupted
                if self._file is not None:
                    self._file.close()
                    partial_path(self.path).unlink(missing_ok=True)
        return self.path


def describe(row: dict) -> str:
    """``gather torch NHD bfloat16 64 tokens 12.31 GB/s`` (a served load step: ``serve disagg 24
    tokens 4 req/s 3/3 done``; a soak window: ``... window 2 (2.0-3.0 s) 17/18 done``): a row in
    one progress line."""
    words = [str(row[k]) for k in ("op", "backend", "layout", "dtype") if row.get(k)]
    if row.get("tokens"):
        words.append(f"{row['tokens']} tokens")
    gbps = row.get("as_called_gbps") or row.get("gbps")
    served = row.get("op") in ("serve", "soak", "soak_window")  # GB/s of an E2E time: none
    if gbps and not served:
        words.append(f"{gbps:.3g} GB/s")
    if "rate" in row and row.get("op") == "serve":  # a served load step: rate None is inf
        words.append(f"{'inf' if row['rate'] is None else format(row['rate'], 'g')} req/s")
    if row.get("window") is not None:  # a soak window
        words.append(f"window {row['window']} ({row.get('t0_s')}-{row.get('t1_s')} s)")
    if "completed" in row or "ok" in row:
        words.append(f"{row.get('completed', row.get('ok'))}/{row.get('requests')} done")
    return " ".join(words)


def say(line: str) -> None:
    """One line on stderr, above a tqdm bar if one is drawn."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:
        tqdm.tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)
