"""Every repository path the docs name exists: paths under the repository's folders (``docs/``,
``bench/`` with ``bench/results/``, ``kvflow/``, ``kernels/``, ``xpu/``, ``tests/``, ``tools/``)
in README.md and docs/**/*.md, and the relative links of those pages; every section those pages
name (``docs/x.md, "Name"``, ``x.md#anchor``), every module (``kvflow.x.y``, a name in it), every
connector kind (``--kv-connector X``) and ``--kv-connector-config`` option exists; no file refers
to the design notes by their old names (DESIGN.md, METHOD.md), which are not in the
repository."""

from __future__ import annotations

import json
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


# ---- sections, modules and connector kinds the docs name --------------------------------------
# `docs/x.md, "Name"` / `x.md ("Name"` / `[x](x.md), "Name"`: a section (heading) or a bold lead
# (**Name.** ...) of that page; `x.md#anchor` / `(#anchor)`: a heading's GitHub anchor.
_SECTION = re.compile(r'((?:\.\./)*[\w./-]*\w\.md)\)?,?\s\(?"([^"\n]{2,80})"')
_ANCHOR = re.compile(r'\]\(((?:\.\./)*[\w./-]*\.md)?#([\w-]+)\)')
_MODULE = re.compile(r"(?<![\w./-])kvflow((?:\.[A-Za-z_]\w*)+)")
_KIND_FLAG = re.compile(r"--kv-connector[ =]([\w-]+)")
_OPTIONS = re.compile(r"--kv-connector-config '(\{[^']*\})'")
#: dotted names the docs give that are not modules: fields of a response's ``kvflow`` object,
#: and modules a page says were removed
NOT_MODULES = {"kvflow.hops_ms", "kvflow.timings_ms",
               "kvflow.native_signal"}  # docs/xpu.md, "No native signaller": removed in issue 15


def _page_file(page: Path, target: str) -> Path | None:
    for base in (page.parent, ROOT):
        if (base / target).is_file():
            return base / target
    return None


def section_names(path: Path) -> list[str]:
    """The headings and bold paragraph leads of markdown page ``path`` (code blocks left out)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return ([m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", text, flags=re.M)]
            + [m.group(1).strip() for m in re.finditer(r"\*\*([^*\n]+)\*\*", text)])


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: ``Listeners on `--host` only`` ->
    ``listeners-on---host-only``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def missing_sections(page: Path) -> list[str]:
    text, out = page.read_text(), []
    for m in _SECTION.finditer(text):
        line, target, name = text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)
        path = _page_file(page, target)
        if path is not None and not any(s == name or s.startswith(name)
                                        for s in section_names(path)):
            out.append(f"{line}: {target} has no section {name!r}")
    for m in _ANCHOR.finditer(text):
        line, target = text.count("\n", 0, m.start()) + 1, m.group(1)
        path = _page_file(page, target) if target else page
        if path is not None and m.group(2) not in {anchor(s) for s in section_names(path)}:
            out.append(f"{line}: {target or page.name} has no anchor #{m.group(2)}")
    return out


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT / ("kernels" if parts[:1] == ["kernels"] else "kvflow")
    rel = parts[1:] if parts[:1] == ["kernels"] else parts
    path = base.joinpath(*rel)
    for cand in (path.with_name(path.name + ".py"), path / "__init__.py"):
        if cand.is_file():
            return cand
    return next(iter(path.parent.glob(path.name + ".*.so")), None) if rel else None


def missing_module(dotted: str) -> str:
    """'' when ``kvflow.<dotted>`` is a module of the package, or a module and a name its source
    defines or imports; else what is missing."""
    parts = dotted.strip(".").split(".")
    for n in range(len(parts), 0, -1):
        path = _module_file(parts[:n])
        if path is None:
            continue
        rest = parts[n:]
        if rest and path.suffix == ".py" and not re.search(rf"\b{rest[0]}\b", path.read_text()):
            return f"{path.relative_to(ROOT)} defines no {rest[0]!r}"
        return ""
    return "no such module"


def test_section_and_module_checks_catch_what_is_gone(tmp_path):
    (tmp_path / "a.md").write_text('# Top\n\n## Lease `kv_lease_s`\n\n**In serving.** x\n')
    page = tmp_path / "b.md"
    page.write_text('see a.md, "In serving" and a.md ("Top" and [l](a.md#lease-kv_lease_s)\n'
                    'but a.md, "Signals" and [g](a.md#gone) and [h](#nothing)\n')
    assert missing_sections(page) == ["2: a.md has no section 'Signals'",
                                      "2: a.md has no anchor #gone",
                                      "2: b.md has no anchor #nothing"]
    assert missing_module(".connector.kinds") == missing_module(".kernels.registry") == ""
    assert missing_module(".kernels.copy_blocks") == missing_module("._native") == ""
    assert missing_module(".connector.kinds.KINDS") == ""
    assert missing_module(".connector.kinds.NOPE") == "kvflow/connector/kinds.py defines no 'NOPE'"
    assert missing_module(".native_signal") == "no such module"


@pytest.mark.parametrize("page", PAGES)
def test_named_sections_modules_and_kinds_exist(page):
    from kvflow.connector import KINDS, check_options

    text, path = (ROOT / page).read_text(), ROOT / page
    missing = [f"{page}:{hit}" for hit in missing_sections(path)]
    for m in _MODULE.finditer(text):
        dotted, line = "kvflow" + m.group(1).rstrip("."), text.count("\n", 0, m.start()) + 1
        if dotted not in NOT_MODULES and (why := missing_module(m.group(1))):
            missing.append(f"{page}:{line}: {dotted}: {why}")
    for m in _KIND_FLAG.finditer(text):
        if m.group(1) != "auto" and m.group(1) not in KINDS:
            missing.append(f"{page}:{text.count(chr(10), 0, m.start()) + 1}: --kv-connector "
                           f"{m.group(1)} is no connector kind")
    for m in _OPTIONS.finditer(text):
        try:
            options = json.loads(m.group(1))
        except json.JSONDecodeError:  # a sketch such as '{"mode": ...}': only its keys count
            options = dict.fromkeys(re.findall(r'"(\w+)"\s*:', m.group(1)))
        for key, value in options.items():
            takers = [k for k, kind in KINDS.items() if key in {o.name for o in kind.options}]
            try:
                if not takers:
                    raise ValueError(f"{key!r} is an option of no connector kind")
                if value is not None:
                    check_options(takers[0], {key: value})
            except ValueError as exc:
                missing.append(f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {exc}")
    assert not missing, "sections, modules or kinds named by the docs that do not exist:\n" + \
        "\n".join(missing)


# ---- flags the docs show: each a flag of today's parser ---------------------------------------
_COMMAND = re.compile(r"python -m kvflow\.(bench|serve)((?: [a-z][\w-]*)?)([^`\n|]*)")


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text))


def shown_flags(text: str) -> list[tuple[int, str, str]]:
    """(line, program, flag) of each flag on a ``python -m kvflow.bench STUDY`` or ``python -m
    kvflow.serve`` command (continued over ``\\`` line ends) and in a ``server_args`` table
    column (flags of ``kvflow.serve``); program is ``serve`` or ``bench STUDY``."""
    out = []
    joined = re.sub(r"\\\n\s*", " ", text)  # continued commands; line numbers of their start
    for m in _COMMAND.finditer(joined):
        line = joined.count("\n", 0, m.start()) + 1
        program = "serve" if m.group(1) == "serve" else f"bench {m.group(2).strip()}"
        rest = m.group(3) if m.group(1) == "bench" else m.group(2) + m.group(3)
        out += [(line, program, f) for f in sorted(_flags(rest))]
    column = None
    for i, row in enumerate(text.splitlines(), 1):
        cells = ([c.strip() for c in row.strip().strip("|").split("|")]
                 if row.startswith("|") else [])
        if "server_args" in cells:
            column = cells.index("server_args")
        elif not cells:
            column = None
        elif column is not None and column < len(cells):
            out += [(i, "serve", f) for f in sorted(_flags(cells[column]))]
    return out


def test_shown_flags_are_found():
    text = ("`python -m kvflow.bench ipc --full --serve-reps 4` and\n```\npython -m kvflow.serve "
            "--role router \\\n  --port 1\n```\n| op | server_args |\n|---|---|\n| a | --x-y 1 |\n")
    assert shown_flags(text) == [(1, "bench ipc", "--full"), (1, "bench ipc", "--serve-reps"),
                                 (3, "serve", "--port"), (3, "serve", "--role"),
                                 (8, "serve", "--x-y")]


@pytest.mark.parametrize("page", PAGES)
def test_shown_flags_exist(page):
    from kvflow.bench.__main__ import build_parser as bench_parser
    from kvflow.serve.launch.config import build_parser as serve_parser

    studies = next(a for a in bench_parser()._actions if a.dest == "study").choices
    known = {"serve": {s for a in serve_parser()._actions for s in a.option_strings}}
    known |= {f"bench {name}": {s for a in p._actions for s in a.option_strings}
              for name, p in studies.items()}
    known["bench "] = {"--help", "-h"}
    missing = [f"{page}:{line}: {program}: {flag}" for line, program, flag in
               shown_flags((ROOT / page).read_text()) if flag not in known.get(program, ())]
    assert not missing, "flags the docs show that the parsers lack:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES)
def test_no_absolute_path_of_one_machine(page):
    """Commands in the docs use paths relative to the repository (or /tmp, /dev/shm), never a
    home or work folder of one machine."""
    text = (ROOT / page).read_text()
    hits = [f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for m in re.finditer(r"(?<![\w.~-])/(?:work|home|Users|root|mnt|data|scratch)/[\w./-]*",
                                 text)]
    assert not hits, "absolute paths of one machine:\n" + "\n".join(hits)
