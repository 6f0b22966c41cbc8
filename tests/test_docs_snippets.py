"""Every code block marked runnable in README.md and docs/ runs, as a user would paste it.

A block is runnable when the line before its ```` ```python ```` fence is
``<!-- runnable -->`` (invisible on GitHub and in the MkDocs site). Each runs in a process
of its own, in an empty directory, with a time limit, and must exit 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from proc_helpers import REPO, clean_env, processes

MARKER = "<!-- runnable -->"
BLOCK = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.S | re.M)
LIMIT_S = 240  # a few seconds of CPU each; generous for a loaded 2-core machine


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the fence's line
            blocks.append((f"{path.relative_to(REPO)}:{line}", match.group(1)))
    return blocks


BLOCKS = runnable_blocks()


def test_every_marker_is_followed_by_a_python_block():
    for path in documents():
        text = path.read_text(encoding="utf-8")
        markers = sum(line.strip() == MARKER for line in text.splitlines())
        assert markers == len(BLOCK.findall(text)), (
            f"{path.relative_to(REPO)}: {MARKER} must stand on the line just before a ```python fence")


def test_the_readme_quick_start_is_runnable():
    assert any(where.startswith("README.md") and "MirroredStrategy" in code for where, code in BLOCKS)


@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_runnable_block(where, code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    launcher = (f"import os, runpy; os.chdir({str(work)!r}); "
                f"runpy.run_path({str(script)!r}, run_name='__main__')")
    with processes(tmp_path) as procs:
        proc = procs.spawn(["-c", launcher], clean_env(), "snippet")
        status = procs.wait(proc, LIMIT_S)
        output = procs.output(proc)
    assert status is not None, f"{where} ran past {LIMIT_S} s:\n{output[-3000:]}"
    assert status == 0, f"{where} exited {status}:\n{output[-3000:]}"


def test_the_readmes_relative_links_lead_to_files():
    """README.md is not part of the site that ``mkdocs build --strict`` checks."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\((?!https?://|#)([^)#]+)", text)
    assert targets
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
