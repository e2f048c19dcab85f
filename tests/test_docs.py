"""Every ```python block of the docs pages below runs, top to bottom, in one namespace per page,
so the docs cannot rot. A failure names the page and the line of the block. The connector table
of docs/design.md is the one the kinds registry generates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["docs/layouts.md"]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each fenced ```python block."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_python_blocks_are_found():
    text = "x\n```python\na = 1\n```\n\n```bash\nls\n```\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n"), (10, "b = 2\n")]


@pytest.mark.parametrize("page", PAGES)
def test_doc_page_runs(page, monkeypatch):
    monkeypatch.delenv("KVFLOW_BACKEND", raising=False)
    path = ROOT / page
    blocks = python_blocks(path.read_text())
    assert len(blocks) >= 5, f"{page} has {len(blocks)} python blocks"
    namespace: dict = {"__name__": "__docs__"}
    for line, code in blocks:
        # pad with blank lines so tracebacks point at the page's own line numbers
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)


def test_design_connector_table_is_the_registrys():
    from kvflow.connector.kinds import KINDS, kinds_table
    text = (ROOT / "docs/design.md").read_text()
    m = re.search(r"<!-- kinds table: begin -->\n(.*?)<!-- kinds table: end -->", text, flags=re.S)
    assert m, "docs/design.md lost its kinds table markers"
    assert m.group(1) == kinds_table(), ("docs/design.md's connector table differs from the "
                                         "registry; paste kvflow.connector.kinds.kinds_table()")
    rows = [r for r in m.group(1).splitlines() if r.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == list(KINDS) == ["ipc-pull", "ipc-push", "tcp", "nixl"]
