"""The README's promises: two commands first (serve, tests), CI runs the same test command, and
the README's Python example runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_two_commands():
    head = README.split("\n## ")[0]
    cmds = [b.strip() for b in _blocks("bash") if b.strip() in head]
    assert len(cmds) == 2, cmds
    assert cmds[0].endswith("python -m kvflow.serve")
    assert "pytest" in cmds[1]
    # Nothing but the title comes before the two commands.
    assert head.index(cmds[0]) < head.index(cmds[1]) < head.index("The first command")


def test_ci_runs_the_readme_test_command():
    test_cmd = _blocks("bash")[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), (test_cmd, ci)


def test_readme_python_example_runs():
    for block in _blocks("python"):
        exec(compile(block, "README.md", "exec"), {})
