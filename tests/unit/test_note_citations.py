"""Every `[Note: X]` citation names a note that exists where it says (no processes).

How notes are written: a note is a paragraph of a docstring or comment that opens with a line
holding only its title, `[Note: <title>]` (in a comment: `# [Note: <title>]`). Titles are
unique in the repository.

How they are cited: `[Note: <title>]` anywhere else, with the exact title (it may wrap across
lines). A citation of a note in another file names that file right after it:
`See [Note: <title>] in engine/autograd.py`, the path relative to the package directory
`fullshard/` or to the repository root (`fullshard/engine/autograd.py`,
`benchmarks/cluster.py`). A citation that names no file cites a note of its own file.

So renaming a note, moving it to another file or deleting it fails here until every citation
follows. Citations in words ("the note on the root", "comm's note") cannot be checked, so the
package, tests and benchmarks may not write them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fullshard"
SCANNED_DIRS = ("fullshard", "benchmarks", "tests", "examples", "docs")
# The records under benchmarks/results are dated measurements: they quote the code of their
# day and are never edited afterwards.
SKIPPED_DIRS = {"__pycache__", "results"}
THIS_FILE = Path(__file__).resolve()  # its docstring shows the forms with placeholders

# A line's indentation and comment markers go, its line break stays (line numbers hold).
_LINE_PREFIX = re.compile(r"^[ \t]*(?:#+[ \t]?)?", re.MULTILINE)
_NOTE = re.compile(r"\[Note:\s+([^\]]+?)\s*\]")
_NAMED_FILE = re.compile(r"\s+in\s+`?([\w./-]+\.(?:py|md))`?")
_DEFINITION = re.compile(r"^\[Note:\s+[^\]]+\]$")
# "see the note on the root", "the Note above", "pairwise.py's note on ...", "the ZeRO-3 note in"
_IN_WORDS = re.compile(
    r"\bsee\s+the\s+notes?\b|\bthe\s+notes?\s+(?:on|in|above|below)\b|'s\s+notes?\s+on\b"
    r"|\bthe\s+[\w-]+\s+notes?\s+(?:on|in)\b",
    re.IGNORECASE,
)


def _files() -> Iterator[Path]:
    yield from sorted(ROOT.glob("*.md"))
    for top in SCANNED_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            skipped = SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts)
            if path.suffix in (".py", ".md") and path.is_file() and not skipped:
                if path.resolve() != THIS_FILE:
                    yield path


def _title(raw: str) -> str:
    return " ".join(raw.split())


def _scan(path: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int, str | None]]]:
    """(title, line) of each note defined in `path`, and (title, line, named file or None) of
    each citation."""
    text = _LINE_PREFIX.sub("", path.read_text(encoding="utf-8"))
    definitions, citations = [], []
    for m in _NOTE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        start = text.rfind("\n", 0, m.start()) + 1
        end = text.find("\n", m.end())
        whole_line = text[start : len(text) if end < 0 else end].strip()
        title = _title(m.group(1))
        if whole_line == m.group(0) and _DEFINITION.match(whole_line):
            definitions.append((title, line))
            continue
        named = _NAMED_FILE.match(text, m.end())
        citations.append((title, line, named.group(1) if named else None))
    return definitions, citations


def _resolve(name: str) -> Path | None:
    for base in (PACKAGE, ROOT):
        path = (base / name).resolve()
        if path.is_file():
            return path
    return None


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _index() -> tuple[dict[str, list[tuple[Path, int]]], dict[Path, list]]:
    defined: dict[str, list[tuple[Path, int]]] = {}
    cited: dict[Path, list] = {}
    for path in _files():
        definitions, citations = _scan(path)
        for title, line in definitions:
            defined.setdefault(title, []).append((path.resolve(), line))
        cited[path.resolve()] = citations
    return defined, cited


def test_the_scan_sees_notes_and_citations():
    defined, cited = _index()
    # A scan that finds nothing would pass every test below.
    assert len(defined) >= 10
    assert sum(len(c) for c in cited.values()) >= 10


def test_note_titles_are_unique():
    defined, _ = _index()
    twice = {
        title: [f"{_rel(p)}:{line}" for p, line in places]
        for title, places in defined.items()
        if len(places) > 1
    }
    assert not twice, f"note titles defined more than once (give each its own title): {twice}"


def test_every_citation_names_an_existing_note():
    defined, cited = _index()
    problems = []
    for path, citations in cited.items():
        for title, line, named in citations:
            where = f"{_rel(path)}:{line}: [Note: {title}]"
            target = path
            if named is not None:
                resolved = _resolve(named)
                if resolved is None:
                    problems.append(
                        f"{where} names {named!r}, which is no file under fullshard/ or the "
                        f"repository root"
                    )
                    continue
                target = resolved
            places = defined.get(title, [])
            if any(p == target for p, _ in places):
                continue
            found = ", ".join(f"{_rel(p)}:{n}" for p, n in places) or "nowhere"
            hint = (
                f"write `[Note: {title}] in <path>`"
                if places
                else "fix the title, or write the note"
            )
            problems.append(f"{where}: no such note in {_rel(target)} (defined: {found}; {hint})")
    assert not problems, "citations of notes that are not where they say:\n" + "\n".join(problems)


def test_notes_are_cited_by_title_not_in_words():
    problems = []
    for path in _files():
        if path.suffix != ".py":
            continue
        text = _LINE_PREFIX.sub("", path.read_text(encoding="utf-8"))
        for m in _IN_WORDS.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{_rel(path)}:{line}: {m.group(0)!r}")
    assert not problems, (
        "notes cited in words, which no test can check; cite the title instead, "
        "`See [Note: <title>] in <path>`:\n" + "\n".join(problems)
    )
