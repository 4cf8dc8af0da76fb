"""Every Python example in README.md and docs/*.md runs, the way a user would run it.

A fenced ```python block is an example. Its first line says how it runs:

    # run: <command>     the block is saved as `example.py` in an empty directory and
                         <command> runs it there, e.g.
                         `# run: fullshard run --nproc-per-node 2 example.py`
                         (`python` and `fullshard` are this interpreter and its fullshard);
    # fragment: <why>    a piece of a larger program (a signature, a loop body): it is only
                         compiled, so a syntax error still fails;
    (anything else)      run as `python example.py`.

Blocks fenced otherwise (```text for output and signatures, ```bash for shell) are not
examples. An example passes when its command exits 0 within EXAMPLE_TIMEOUT seconds; a block
that raises, prints a traceback and exits non-zero, or hangs, fails its test, which names the
file and line of the block. Keep examples small (tiny models, a step or two): the whole file
should take well under a minute on 2 cores.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.test_fabric import ROOT, child_env

EXAMPLE_TIMEOUT = 120
# The user's guide; docs/architecture.md is for contributors and may hold no examples.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDE_PAGES = [p for p in PAGES if p.parent.name == "docs" and p.name != "architecture.md"]
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.lstrip("\n").split("\n", 1)[0].strip()


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, in order."""
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page.name}:{i + 1}: a code fence that is never closed")
        found.append(Block(page, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


EXAMPLES = [b for page in PAGES for b in blocks(page) if b.lang == "python"]


def command(block: Block) -> list[str]:
    """The argv that runs `block` saved as example.py, from its `# run:` line."""
    if not block.first_line.startswith("# run:"):
        return [sys.executable, "example.py"]
    argv = shlex.split(block.first_line.removeprefix("# run:"))
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    if argv[0] == "fullshard":
        return [sys.executable, "-m", "fullshard.cli", *argv[1:]]
    raise AssertionError(f"{block.where}: '# run:' must start with python or fullshard: {argv}")


def test_the_guide_has_examples() -> None:
    """Each page of the user's guide starts with a runnable example (its first code block)."""
    assert GUIDE_PAGES, "docs/ has no pages"
    for page in GUIDE_PAGES:
        first = next(iter(blocks(page)), None)
        assert first is not None and first.lang == "python", (
            f"{page.name}: its first code block should be a runnable ```python example"
        )
        assert not first.first_line.startswith("# fragment:"), f"{first.where} is a fragment"


@pytest.mark.parametrize("block", EXAMPLES, ids=lambda b: b.where)
def test_example_runs(block: Block, tmp_path: Path) -> None:
    if block.first_line.startswith("# fragment:"):
        compile(block.code, block.where, "exec")
        return
    (tmp_path / "example.py").write_text(block.code)
    argv = command(block)
    try:
        proc = subprocess.run(argv, cwd=tmp_path, env=child_env(), capture_output=True,
                              text=True, timeout=EXAMPLE_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.where}: `{shlex.join(argv)}` ran past {EXAMPLE_TIMEOUT} s\n"
                    f"{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (
        f"{block.where}: the example exited with {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
