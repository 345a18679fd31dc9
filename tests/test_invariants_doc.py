"""docs/invariants.md against the code that cites it: every test it lists exists, every invariant
number cited in tracetrain/, tests/, docs/ and the README is a heading there, no file cites the
design file outside the repository, and every built invariant (1-10) lists at least one test.

Each check is a function of text, so the planted-mistake tests below call it on made-up text and
show that it can fail. This file is left out of the scan: its made-up texts cite on purpose.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "invariants.md"
BUILT = range(1, 13)
PARTLY: tuple[int, ...] = ()  # built in part: a listed test, and what is not built yet
SCANNED = [ROOT / "tracetrain", ROOT / "tests", ROOT / "docs", ROOT / "README.md"]
SUFFIXES = {".py", ".md", ".html", ".js", ".txt", ".toml", ".yaml", ".yml", ".cfg"}
OUTSIDE_DESIGN = "DESIGN" + ".md"  # spelled apart so this file does not cite it

HEADING = re.compile(r"^## (\d+)\. ", re.M)
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
# "invariant 4", "invariants 1-3, 7, 8", "docs/invariants.md invariant 9", "invariants.md 7 and 8",
# "(docs/invariants.md, 3: partition)"
CITATION = re.compile(
    r"\binvariants?(?:\.md)?[,:]?\s+(?:invariants?\s+)?(\d+(?:\s*(?:-|–|,|and)\s*\d+)*)",
    re.IGNORECASE,
)


def sections(doc: str) -> dict[int, str]:
    """Invariant number -> the text of its section (up to the next heading of any level 2)."""
    out: dict[int, str] = {}
    marks = list(HEADING.finditer(doc))
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(doc)
        out[int(m.group(1))] = doc[m.end():end].split("\n## ", 1)[0]
    return out


def listed_tests(text: str) -> list[tuple[str, str]]:
    return TEST_REF.findall(text)


def defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def missing_tests(doc: str, root: Path = ROOT) -> list[str]:
    """Each `tests/x.py::name` of the doc whose file is absent or defines no function `name`."""
    missing = []
    for rel, name in listed_tests(doc):
        path = root / rel
        if not path.is_file() or name not in defined_names(path):
            missing.append(f"{rel}::{name}")
    return missing


def cited_numbers(text: str) -> list[tuple[int, int]]:
    """(line number, invariant number) of every citation; "1-3" gives 1, 2 and 3."""
    out = []
    for m in CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        for part in re.split(r"\s*(?:,|and)\s*", m.group(1)):
            ends = [int(x) for x in re.split(r"\s*[-–]\s*", part)]
            out.extend((line, n) for n in range(ends[0], ends[-1] + 1))
    return out


def bad_citations(name: str, text: str, numbers: set[int]) -> list[str]:
    """Citations of an invariant that has no heading, and any mention of the outside design file."""
    bad = [f"{name}:{line}: invariant {n} is no heading of docs/invariants.md"
           for line, n in cited_numbers(text) if n not in numbers]
    bad += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: cites {OUTSIDE_DESIGN}"
            for m in re.finditer(re.escape(OUTSIDE_DESIGN), text)]
    return bad


def built_without_tests(doc: str) -> list[int]:
    """Built invariants whose section lists no test, unbuilt ones that list one or do not say
    they are not built, and partly built ones that lack either (a test, and what is not built)."""
    secs = sections(doc)
    wrong = [n for n in BUILT if n not in secs or not listed_tests(secs[n])]
    for n, text in secs.items():
        unbuilt_said = "not built yet" in text.lower()
        if n in PARTLY and not (listed_tests(text) and unbuilt_said):
            wrong.append(n)
        elif n not in BUILT and n not in PARTLY and (listed_tests(text) or not unbuilt_said):
            wrong.append(n)
    return wrong


def scanned_files() -> list[Path]:
    me = Path(__file__).resolve()
    files = []
    for top in SCANNED:
        found = [top] if top.is_file() else sorted(top.rglob("*"))
        files += [p for p in found if p.is_file() and p.suffix in SUFFIXES
                  and "__pycache__" not in p.parts and p.resolve() != me]
    return files


# --- the repository ------------------------------------------------------------------------------


def test_the_doc_numbers_every_invariant_once_in_order():
    assert [int(n) for n in HEADING.findall(DOC.read_text(encoding="utf-8"))] == list(range(1, 13))


def test_every_listed_test_exists():
    doc = DOC.read_text(encoding="utf-8")
    assert len(listed_tests(doc)) >= len(BUILT)
    assert missing_tests(doc) == []


def test_every_invariant_citation_resolves_and_none_cites_the_outside_design_file():
    numbers = set(sections(DOC.read_text(encoding="utf-8")))
    files = scanned_files()
    assert any(p.suffix == ".py" and p.is_relative_to(ROOT / "tracetrain") for p in files)
    bad, n_cited = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        n_cited += len(cited_numbers(text))
        bad += bad_citations(str(path.relative_to(ROOT)), text, numbers)
    assert n_cited > 10  # the scan sees the code's citations
    assert bad == []


def test_each_built_invariant_lists_a_test_and_the_unbuilt_ones_none():
    assert built_without_tests(DOC.read_text(encoding="utf-8")) == []


# --- each check fails on a planted mistake --------------------------------------------------------

MADE_UP = """## 1. Split

- `tests/objective/test_loss.py::test_split_invariance_of_loss_and_gradient`
- `tests/objective/test_loss.py::test_no_such_test`
- `tests/objective/test_nowhere.py::test_split_invariance_of_loss_and_gradient`

## 2. Mass

No test here.

## 11. Mass per policy

Not built yet: issue 44.

## 12. Policy isolation

- `tests/objective/test_loss.py::test_mass_is_one_for_every_mean_mode`

## 13. Not yet an invariant

- `tests/objective/test_loss.py::test_mass_is_one_for_every_mean_mode`
"""


def test_a_missing_test_or_file_is_found():
    assert missing_tests(MADE_UP) == [
        "tests/objective/test_loss.py::test_no_such_test",
        "tests/objective/test_nowhere.py::test_split_invariance_of_loss_and_gradient",
    ]


def test_citation_forms_are_read():
    text = ("(docs/invariants.md invariant 4)\nas properties (docs/invariants.md invariants 1-3, 7, 8)\n"
            "Invariants (docs/invariants.md 7 and 8, tests/x.py)\n(docs/invariants.md, 3: partition)\n"
            "invariant 10 holds; an invariant: a[:lo] == b[:lo]")
    assert cited_numbers(text) == [(1, 4), (2, 1), (2, 2), (2, 3), (2, 7), (2, 8), (3, 7), (3, 8),
                                   (4, 3), (5, 10)]


def test_a_planted_bad_citation_is_found():
    numbers = set(range(1, 13))
    assert bad_citations("ok.py", "keeps invariant 12 and invariants 3-5", numbers) == []
    assert bad_citations("x.py", "line\n(docs/invariants.md invariant 13)", numbers) == [
        "x.py:2: invariant 13 is no heading of docs/invariants.md"]
    assert bad_citations("y.py", "see invariants 11-14", numbers) == [
        "y.py:1: invariant 13 is no heading of docs/invariants.md",
        "y.py:1: invariant 14 is no heading of docs/invariants.md"]
    assert bad_citations("z.md", f"the shared picture\n\nSee ../shared/{OUTSIDE_DESIGN}", numbers) == [
        f"z.md:3: cites {OUTSIDE_DESIGN}"]


def test_a_planted_bad_citation_in_a_copy_of_the_package_is_found(tmp_path):
    numbers = set(sections(DOC.read_text(encoding="utf-8")))
    source = (ROOT / "tracetrain" / "objective" / "minibatch.py").read_text(encoding="utf-8")
    assert bad_citations("minibatch.py", source, numbers) == []
    first = CITATION.search(source)  # the file's first citation, whatever its number
    assert first is not None
    line = source.count("\n", 0, first.start()) + 1
    planted = tmp_path / "minibatch.py"
    planted.write_text(source[:first.start(1)] + "40" + source[first.end(1):], encoding="utf-8")
    assert bad_citations("minibatch.py", planted.read_text(encoding="utf-8"), numbers) == [
        f"minibatch.py:{line}: invariant 40 is no heading of docs/invariants.md"]


def test_a_built_invariant_without_tests_and_an_unbuilt_one_with_tests_are_found():
    # 2-11, built, list no test (11 says it is not built yet: no matter); 12 lists one; 13, not
    # built, lists a test and does not say it is not built
    assert built_without_tests(MADE_UP) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13]
