"""The numbers the README and the lessons' docstrings quote are the numbers the demos print.

Each lesson's README section has a **Look for** list; every `backticked` span in it is a
piece of that lesson's printed output, and this test runs the lesson (`python 0N_x.py`, as
the README says) and finds the span there. A docstring quotes its demo the same way, as a
backticked span right after the word "prints". The demos train on support/demo_corpus.txt,
a frozen text, so editing a lesson changes its numbers only when it changes what it computes.

Matching is exact, whitespace aside, except `…`, which stands for anything on one line: a
timing or a thread-dependent number is written `…` in the README, never quoted as a number.
Edit any quoted number in the README and its test fails.
"""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LESSONS = sorted(p.name for p in ROOT.glob("[0-9][0-9]_*.py"))


def look_for_quotes(number: str) -> list[str]:
    """The backticked spans of the **Look for** list in README's section `## NN · ...`."""
    section = re.search(rf"^## {number} ·.*?(?=^## )", README, re.S | re.M)
    assert section, f"README has no section '## {number} ·'"
    block = re.search(r"\*\*Look for\*\*(.*?)(?=^\*\*|\Z)", section.group(0), re.S | re.M)
    assert block, f"README's section {number} has no **Look for** list"
    return re.findall(r"`([^`]+)`", block.group(1))


def docstring_quotes(lesson: str) -> list[str]:
    """Backticked spans right after the word 'prints' in the lesson's opening docstring."""
    text = (ROOT / lesson).read_text()
    doc = re.match(r'\s*"""(.*?)"""', text, re.S)
    return re.findall(r"prints\s+`([^`]+)`", doc.group(1)) if doc else []


def as_pattern(quote: str) -> str:
    """A regex for a quote: whitespace runs match any whitespace, `…` matches one line's text."""
    pieces = [re.escape(piece) for piece in re.split(r"\s+", quote.strip())]
    return r"\s+".join(pieces).replace(re.escape("…"), r"[^\n]*?")


@functools.cache
def demo_output(lesson: str, tmp: str) -> str:
    """Run `python lesson` from the repository root, as a reader does; its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg", DEMO_OUT=tmp)
    done = subprocess.run(
        [sys.executable, lesson],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{lesson} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize("lesson", LESSONS)
def test_quoted_output_is_printed(lesson, tmp_path_factory):
    quotes = look_for_quotes(lesson[:2]) + docstring_quotes(lesson)
    assert quotes, f"README quotes nothing of {lesson}'s output"
    out = demo_output(lesson, str(tmp_path_factory.mktemp(lesson[:2])))
    missing = [q for q in quotes if not re.search(as_pattern(q), out)]
    assert not missing, f"{lesson} does not print {missing}; it printed:\n{out}"


def test_an_edited_number_is_caught():
    printed = "cleaning: kept 650 of 654 documents; removed: exact duplicate (4)\nnaive 3.1 s"
    assert re.search(as_pattern("kept 650 of 654 documents"), printed)
    assert not re.search(as_pattern("kept 651 of 654 documents"), printed)
    assert re.search(as_pattern("naive … s"), printed)
    assert not re.search(as_pattern("naive … s, same merges"), printed)
