"""Every repository path the docs name exists: paths under the repository's folders (``docs/``,
``bench/`` with ``bench/results/``, ``kvflow/``, ``kernels/``, ``xpu/``, ``tests/``, ``tools/``)
in README.md and docs/**/*.md, and the relative links of those pages; no file refers to the
design notes by their old names (DESIGN.md, METHOD.md), which are not in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# A path starts at a word boundary (not inside another path, not an #include-style <header>),
# runs over path characters (a glob's * included) and stops before a placeholder (<dir>), a
# quote, a bracket or white space; trailing punctuation is not part of it.
_PATH = re.compile(r"(?<![\w./<-])((?:docs|bench|kvflow|kernels|xpu|tests|tools)/[\w.*/-]*)")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def repo_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of each path under a repository folder in ``text``; a path cut short by a
    placeholder (``docs/img/<name>.png``) is left out."""
    out = []
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        if text[m.end():m.end() + 1] in ("<", "{"):  # a template, not a path
            continue
        out.append((text.count("\n", 0, m.start()) + 1, path))
    return out


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of each markdown link that is not a URL or an in-page anchor."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _LINK.finditer(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1))]


def _exists(path: Path) -> bool:
    if "*" in path.name or "*" in str(path.parent):
        return any(ROOT.glob(path.relative_to(ROOT).as_posix()))
    return path.exists()


def test_path_patterns():
    text = ("see `docs/design.md`, bench/results/a.json. and docs/img/<name>.png or "
            "(bench/results/raw/sweep-*) <xpu/runtime.h> [x](layouts.md#ops) [y](https://a.b/c) [z](#top)")
    assert repo_paths(text) == [(1, "docs/design.md"), (1, "bench/results/a.json"),
                                (1, "bench/results/raw/sweep-*")]
    assert relative_links(text) == [(1, "layouts.md")]


@pytest.mark.parametrize("page", PAGES)
def test_named_paths_exist(page):
    text = (ROOT / page).read_text()
    missing = [f"{page}:{line}: {path}" for line, path in repo_paths(text) if not _exists(ROOT / path)]
    missing += [f"{page}:{line}: {target}" for line, target in relative_links(text)
                if not _exists((ROOT / page).parent / target)]
    assert not missing, "paths named by the docs that do not exist:\n" + "\n".join(missing)


def test_no_reference_to_missing_design_notes():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        if name == "tests/test_doc_refs.py" or not name.endswith((".py", ".md", ".cc", ".h", ".toml")):
            continue
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if re.search(r"\b(DESIGN|METHOD)\.md\b", line):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "references to DESIGN.md / METHOD.md (not in the repository; see docs/design.md):\n" + \
        "\n".join(hits)
