"""The numbers the README and the lessons' docstrings quote are the numbers the demos print.

Each lesson's README section has a **Look for** list; every `backticked` span in it is a
piece of that lesson's printed output, and this test runs the lesson (`python 0N_x.py`, as
the README says) and finds the span there. A docstring quotes its demo the same way, as a
backticked span right after the word "prints". A **Try** item that quotes a variant's output
says "prints `...`" after its command (its first backticked span: `python 0N_x.py ARGS`, or
just `--flags` for the section's lesson), and that command is run too. The demos train on
support/frozen_corpus.txt, a frozen text, so a lesson's numbers change only when what it
computes changes. Every run happens in a temporary folder, so `data/` and `out/` stay clean.

Matching is exact, whitespace aside, except `…`, which stands for anything on one line: a
timing or a thread-dependent number is written `…` in the README, never quoted as a number.
Edit any quoted number in the README and its test fails.
"""

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LESSONS = sorted(p.name for p in ROOT.glob("[0-9][0-9]*_*.py"))  # 01_data.py, 01b_...


def look_for_quotes(number: str) -> list[str]:
    """The backticked spans of the **Look for** list in README's section `## NN · ...`."""
    section = re.search(rf"^## {number} ·.*?(?=^## )", README, re.S | re.M)
    assert section, f"README has no section '## {number} ·'"
    # The list (or the paragraph) ends at the first blank line.
    block = re.search(r"\*\*Look for\*\*(.*?)(?=\n\n|\Z)", section.group(0), re.S)
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


def try_runs(number: str) -> list[tuple[list[str], list[str]]]:
    """(arguments, quotes) of each **Try** item in section NN that says "prints `...`"."""
    section = re.search(rf"^## {number} ·.*?(?=^## )", README, re.S | re.M).group(0)
    block = re.search(r"\*\*Try\*\*(.*?)(?=^\*\*|^!|\Z)", section, re.S | re.M)
    items = re.split(r"^\d+\. ", block.group(1), flags=re.M) if block else []
    runs = []
    for item in items:
        quotes = re.findall(r"prints\s+`([^`]+)`", item)
        if not quotes:
            continue
        command = re.search(r"`([^`]+)`", item).group(1).split()
        if command[0] == "python":
            command = command[1:]
        else:  # `--flags` alone: the section's own lesson
            command = [lesson_file(number), *command]
        runs.append((command, quotes))
    return runs


def lesson_file(number: str) -> str:
    """The lesson a section's number names: "03" -> 03_ddp.py, "03b" -> 03b_compression.py."""
    return next(name for name in LESSONS if name.startswith(number + "_"))


@functools.cache
def script_output(args: tuple[str, ...]) -> tuple[int, str]:
    """Run `python ARGS` once per session, in a fresh temporary folder, the lesson found in the
    repository: (exit code, stdout then stderr). A lesson's own demo test (test_ddp's,
    test_zero's) reads the same run as its README check: one run of the demo, not two."""
    # One thread unless the caller sets another: the quoted numbers must hold at any count
    # and on any CPU kernels (ATEN_CPU_CAPABILITY=default|avx2|avx512, README's Tests).
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    env = dict(os.environ, OMP_NUM_THREADS=threads, MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="demo-") as cwd:
        done = subprocess.run(
            [sys.executable, str(ROOT / args[0]), *args[1:]],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    return done.returncode, done.stdout + done.stderr


def run_output(args: tuple[str, ...], must_succeed: bool = True) -> str:
    """script_output's text; with must_succeed, a non-zero exit fails the test."""
    code, out = script_output(args)
    if must_succeed:
        assert code == 0, f"python {' '.join(args)} failed:\n{out[-4000:]}"
    return out


def missing(quotes: list[str], out: str) -> list[str]:
    return [q for q in quotes if not re.search(as_pattern(q), out)]


@pytest.mark.parametrize("lesson", LESSONS)
def test_quoted_output_is_printed(lesson):
    quotes = look_for_quotes(lesson.split("_")[0]) + docstring_quotes(lesson)
    assert quotes, f"README quotes nothing of {lesson}'s output"
    out = run_output((lesson,))
    assert not missing(quotes, out), (
        f"{lesson} does not print {missing(quotes, out)}:\n{out}"
    )


TRIES = [
    (n, args, q)
    for n in sorted({x.split("_")[0] for x in LESSONS})
    for args, q in try_runs(n)
]


@pytest.mark.parametrize(
    "number, args, quotes", TRIES, ids=[" ".join(t[1]) for t in TRIES]
)
def test_try_items_print_what_they_quote(number, args, quotes):
    # A Try may end in the one-line error it describes, so its exit code is not checked.
    out = run_output(tuple(args), must_succeed=False)
    assert not missing(quotes, out), (
        f"python {' '.join(args)} does not print {missing(quotes, out)}:\n{out}"
    )


def test_an_edited_number_is_caught():
    printed = (
        "cleaning: kept 650 of 654 documents; removed: exact duplicate (4)\nnaive 3.1 s"
    )
    assert re.search(as_pattern("kept 650 of 654 documents"), printed)
    assert not re.search(as_pattern("kept 651 of 654 documents"), printed)
    assert re.search(as_pattern("naive … s"), printed)
    assert not re.search(as_pattern("naive … s, same merges"), printed)
