"""docs/workshop.md and the README's break-it exercises name code that exists.

The workshop plan lists, for each lesson, the functions a teacher reads aloud; a README
**Try** item that says "In `NaiveDataParallel.all_reduce_gradients`, drop ..." sends a
reader to one function. Rename or delete one and these tests name the stale reference.
The glossary must define every symbol the plan's lessons are built on.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLAN = (ROOT / "docs" / "workshop.md").read_text()
README = (ROOT / "README.md").read_text()
LESSONS = sorted(p.name for p in ROOT.glob("[0-9][0-9]*_*.py"))
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")  # `fn` or `Class.method`


def defined_names(path: Path) -> set[str]:
    """A file's top-level functions and classes, and each class's methods as Class.m."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(f"{node.name}.{item.name}")
    return names


def plan_entries() -> list[tuple[str, list[str]]]:
    """(file, names) of each `- **`FILE`**` bullet; its Exercise sentence quotes output
    and flags, not code, so it is left out."""
    entries = []
    for bullet in re.split(r"\n(?=- \*\*`)", PLAN):
        bullet = bullet.split("\n\n")[0]  # a blank line ends the list
        head = re.match(r"- \*\*`([^`]+)`\*\*", bullet)
        if not head:
            continue
        code = re.sub(r"Exercise:.*?(?=Skip:|\Z)", "", bullet, flags=re.S)
        spans = re.findall(r"`([^`]+)`", code)[1:]  # the first is the file itself
        entries.append((head.group(1), [s for s in spans if NAME.fullmatch(s)]))
    return entries


def test_the_plan_covers_every_lesson_and_train_py():
    named = {file for file, _ in plan_entries()}
    assert set(LESSONS) | {"train.py"} == named, "docs/workshop.md: lessons missing"


@pytest.mark.parametrize("file, names", plan_entries(), ids=lambda x: str(x)[:40])
def test_every_function_the_plan_names_exists_in_its_file(file, names):
    assert names, f"docs/workshop.md names no function of {file}"
    missing = set(names) - defined_names(ROOT / file)
    assert not missing, f"docs/workshop.md names {sorted(missing)}, not in {file}"


def break_it_targets() -> list[tuple[str, str]]:
    """(lesson, name) of each README Try item that opens "In `name`"."""
    targets = []
    for section in re.finditer(r"^## (\S+) ·.*?(?=^## |\Z)", README, re.S | re.M):
        number = section.group(1)
        lesson = next((f for f in LESSONS if f.startswith(number + "_")), None)
        for name in re.findall(r"^\d+\. In `([^`]+)`", section.group(0), re.M):
            targets.append((lesson or number, name))
    return targets


def test_the_readme_has_break_it_exercises():
    assert len(break_it_targets()) >= 8


@pytest.mark.parametrize("lesson, name", break_it_targets())
def test_each_break_it_exercise_names_a_function_of_its_lesson(lesson, name):
    assert lesson in LESSONS, f"README section {lesson} has no lesson file"
    assert name in defined_names(ROOT / lesson), f"README: `{name}` is not in {lesson}"


def test_the_glossary_defines_the_formulas_symbols():
    glossary = PLAN.split("## Glossary", 1)[-1]
    rows = re.findall(r"^\| ([^|]+) \|", glossary, re.M)
    symbols = {s.strip() for row in rows for s in row.split(",")}
    want = {"B", "T", "C", "nh", "hs", "V", "L", "N", "Ψ", "S", "E", "p", "m", "v", "b"}
    assert want <= symbols, f"the glossary lacks {sorted(want - symbols)}"
