"""The house rules, checked on the source: who imports whom, the line budgets,
and the reader's density (long lines, packed assignments, formatter switches).

Each rule fails when broken: import 07 from 03, add 40 lines of 100 characters to 02, or
write `a, b = 1, 2` in a lesson, and the matching test goes red.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The numbered lessons and their lettered extensions (01_data.py, 01b_cleaning.py, ...).
LESSONS = sorted(p.name for p in ROOT.glob("[0-9][0-9]*_*.py"))
BUDGETS = {"train.py": 500}  # every lesson: 600 lines
LONG = 88  # the formatter's line length (pyproject.toml)
LONG_SHARE = 0.05  # at most 5% of a file's lines longer than LONG


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports: `import x`, `from x import y` (x, and x.y: y may be a
    module, as in `from support import train`), import_module("x"). No relative imports:
    a path must say what it reads."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}:{node.lineno}: a relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and call_name(node) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    return names


def call_name(node: ast.Call) -> str:
    """f for f(...) and m.f(...) alike."""
    return getattr(node.func, "attr", getattr(node.func, "id", ""))


def numbered(module: str) -> tuple[int, str] | None:
    """A lesson's place in the reading order: 03_ddp -> (3, ""), 03b_compression -> (3, "b").
    A lettered file extends its parent and comes after it, before the next number."""
    match = re.match(r"(\d\d)([a-z]?)_", module)
    return (int(match.group(1)), match.group(2)) if match else None


def test_a_lettered_lesson_comes_after_its_parent():
    assert numbered("03_ddp") < numbered("03b_compression") < numbered("04_tensor_parallel")
    assert numbered("support.files") is None


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_lesson_imports_only_lower_numbers_and_support(lesson):
    mine = numbered(lesson)
    for module in imported_modules(ROOT / lesson):
        n = numbered(module)
        assert n is None or n < mine, f"{lesson} imports {module}: a later lesson"
        assert not module.startswith("bench"), f"{lesson} imports {module}: bench/ only measures"
        assert module != "train", f"{lesson} imports train.py"


def test_support_imports_no_lesson_and_nothing_imports_bench():
    for path in sorted((ROOT / "support").rglob("*.py")):
        for module in imported_modules(path):
            assert numbered(module) is None, f"{path.relative_to(ROOT)} imports {module}"
            assert not module.startswith(("bench", "train")), f"{path.name}: {module}"
    outside = [ROOT / "train.py", *ROOT.glob("tests/*.py")]
    for path in outside:
        for module in imported_modules(path):
            assert not module.startswith("bench"), f"{path.name} imports {module}"


# support/ by owner. A package named after a parent lesson's stem (support/pipeline/ for
# 05_pipeline.py) holds that lesson's plumbing and its lettered extensions'; support/train/
# is train.py's; a module at the top is shared. SHARED lists those, so a new file must
# choose its owner here.
SHARED = {"distributed", "files", "gpus", "meta"}
STEMS = {name[3:-3]: numbered(name) for name in LESSONS if numbered(name)[1] == ""}
TRAIN = (100, "")  # train.py reads after every lesson


def owner(module: str) -> tuple[int, str] | None:
    """Where `module` sits in the reading order: a lesson's place, TRAIN, or None for
    shared plumbing (and for anything outside support/). A stray module fails here."""
    parts = module.split(".")
    if parts[0] != "support" or len(parts) == 1:
        return None
    if parts[1] == "train":
        return TRAIN
    if parts[1] in STEMS:
        return STEMS[parts[1]]
    assert parts[1] in SHARED, f"{module}: no owner (a lesson's package, train/ or SHARED)"
    return None


def test_support_is_grouped_by_owner(tmp_path):
    """A module at the top is SHARED or named after a lesson (support/ring.py would be
    08's, were 08's plumbing one file); a folder is a lesson's package or train/."""
    top = {p.stem for p in (ROOT / "support").glob("*.py")} - {"__init__"}
    assert top - set(STEMS) == SHARED, f"support/'s shared modules changed: {top ^ SHARED}"
    for folder in (p for p in (ROOT / "support").iterdir() if p.is_dir()):
        if folder.name != "__pycache__":
            assert folder.name in {*STEMS, "train"}, f"support/{folder.name}/: whose?"
            assert (folder / "__init__.py").exists(), f"support/{folder.name}/ is no package"
    assert owner("support.pipeline.gantt") == (5, "") and owner("support.files") is None
    assert owner("support.train.config") == TRAIN and STEMS["data"] == (1, "")
    # Each way to spell an import is seen: `from support import train` too.
    spelled = "from support import train\nimport_module('support.pipeline.gantt')\n"
    probe = tmp_path / "probe.py"
    probe.write_text(spelled)
    assert {"support.train", "support.pipeline.gantt"} <= imported_modules(probe)


def test_support_has_no_import_cycle():
    """support/ modules import each other without a cycle (a lazy import inside a
    function counts too): config.py and recipe.py once imported each other."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts): p
             for p in (ROOT / "support").rglob("*.py")}
    edges = {m: {i for i in imported_modules(p) if i in paths and i != m}
             for m, p in paths.items()}
    done = set()

    def visit(module, chain):
        assert module not in chain, f"an import cycle: {' -> '.join([*chain, module])}"
        if module not in done:
            for nxt in sorted(edges[module]):
                visit(nxt, [*chain, module])
            done.add(module)

    for module in sorted(paths):
        visit(module, [])


def importers():
    """(file, its place in the reading order) for each file the owner rule binds."""
    for lesson in LESSONS:
        yield ROOT / lesson, numbered(lesson)
    yield ROOT / "train.py", TRAIN
    for path in (ROOT / "support").rglob("*.py"):
        package = path.relative_to(ROOT / "support").parts[0]
        yield path, TRAIN if package == "train" else STEMS.get(package, (-1, ""))


def test_a_file_imports_support_only_of_its_owner_or_earlier():
    """Lesson N imports a package of lesson <= N (04b may read 04's sharding); a shared
    module imports shared ones only; 09_plan.py may read train/ (it plans train.py's
    settings), no other lesson may. Move support/train/config.py's import into 07 and
    this goes red."""
    for path, place in importers():
        for module in imported_modules(path):
            mine = owner(module)
            if mine is None or (path.name == "09_plan.py" and mine == TRAIN):
                continue
            assert mine <= place, f"{path.relative_to(ROOT)} imports {module}"


BENCH = sorted((ROOT / "bench").glob("*.py"))


def bench_scripts_smoked() -> set[str]:
    """The scripts tests/test_bench.py's SMOKE table runs (read from its source)."""
    tree = ast.parse((ROOT / "tests" / "test_bench.py").read_text())
    for node in ast.walk(tree):
        named = isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SMOKE"
        if named and isinstance(node.value, ast.Dict):
            return {key.value for key in node.value.keys}
    raise AssertionError("tests/test_bench.py has no SMOKE table")


def test_every_bench_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH if p.name != "timing.py"}
    assert scripts == bench_scripts_smoked(), "bench/ and tests/test_bench.py's SMOKE differ"


@pytest.mark.parametrize("path", BENCH, ids=lambda p: p.name)
def test_a_bench_script_imports_no_other_bench_script(path):
    """bench/timing.py is the one module they share; a script may import itself by name
    (bench_pipeline's ranks find rank_main so)."""
    names = imported_modules(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "bench":  # from bench import x
            names.discard("bench")
            names.update(f"bench.{alias.name}" for alias in node.names)
    for module in names:
        if module.startswith("bench"):
            assert module in ("bench.timing", f"bench.{path.stem}"), f"{path.name}: {module}"
    assert density_problems(path, budget=None) == [], path.name


def density_problems(path: Path, budget: int | None = 600) -> list[str]:
    """What breaks the density rules in one file (an empty list: none)."""
    lines = path.read_text().split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    problems = []
    budget = BUDGETS.get(path.name, budget)
    if budget is not None and len(lines) > budget:
        problems.append(f"{len(lines)} lines, budget {budget}")
    long = [i + 1 for i, line in enumerate(lines) if len(line) > LONG]
    if budget is not None and len(long) > LONG_SHARE * len(lines):
        share = len(long) / len(lines)
        problems.append(f"{share:.1%} of lines over {LONG} characters (lines {long[:8]}...)")
    switches = [i + 1 for i, line in enumerate(lines) if re.search(r"#\s*fmt:\s*(off|skip)", line)]
    if switches:
        problems.append(f"formatter switched off at lines {switches}")
    for node in ast.walk(ast.parse(path.read_text())):
        packed = isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
        if packed and isinstance(node.value, ast.Tuple | ast.List):
            problems.append(f"line {node.lineno} assigns several names from a packed tuple")
    return problems


@pytest.mark.parametrize("name", [*LESSONS, "train.py"])
def test_budget_and_density(name):
    assert density_problems(ROOT / name) == [], name


def test_the_density_check_can_fail(tmp_path):
    packed = tmp_path / "02_x.py"
    packed.write_text("a, b = 1, 2\n" + "x = 1  # " + "y" * 90 + "\n")
    problems = density_problems(packed)
    assert any("packed" in p for p in problems) and any("over 88" in p for p in problems)


PLAN_A_RUN = """
import sys, train
config = train.model_lib.GPTConfig.from_preset("gpt2")
train.model_lib.count_params(config)
train.plan_lib.model_state_bytes(config, train.plan_lib.Layout(dp=2, zero=1), lora_rank=4)
print("torch._dynamo" in sys.modules)
"""


def test_importing_and_counting_leave_torch_dynamo_out():
    """torch._dynamo adds ~3 s to each process that imports it (train.py took 7.1 s to
    import with it, 4.0 s without, on a 2-core VM). torch.optim's optimizers import it
    when built, torch.compile and 08's ring (once CP is applied) too; nothing else should,
    so that --help, --plan, --sample, 09 and 08's demo ranks start without it. Decorate a
    function of any lesson with @torch.compiler.disable, or count 02's parameters on the
    meta device without support/meta.py's shapes_only, and this goes red."""
    code = PLAN_A_RUN
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.stdout.strip() == "False", done.stdout + done.stderr


# A docs page opens with "# Title", a blank line, then a sentence that starts with PURPOSE.
PURPOSE = "Why this page: "


def docs_problems(root: Path) -> list[str]:
    """Each docs/*.md must be linked from the README, as [text](docs/NAME.md), and open
    with `# Title`, a blank line, and a line starting with PURPOSE: the reason the page
    exists. A README link to a page that does not exist is a problem too."""
    readme = (root / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([^)#\s]+\.md)", readme))
    pages = {p.name: p for p in (root / "docs").glob("*.md")}
    unlinked = sorted(pages.keys() - linked)
    missing = sorted(linked - pages.keys())
    problems = [f"docs/{name} is not linked from the README" for name in unlinked]
    problems += [f"the README links docs/{name}, which does not exist" for name in missing]
    for name, page in sorted(pages.items()):
        head = page.read_text().split("\n")[:3]
        opens = len(head) == 3 and head[0].startswith("# ") and head[1] == ""
        if not (opens and head[2].startswith(PURPOSE)):
            opening = f"'# Title', '', '{PURPOSE}...'"
            problems.append(f"docs/{name} does not open with {opening}")
    return sorted(problems)


def test_every_docs_page_is_linked_and_says_why_it_exists():
    assert docs_problems(ROOT) == []


def test_the_docs_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[a](docs/a.md) [gone](docs/gone.md)\n")
    (tmp_path / "docs" / "a.md").write_text(f"# A\n\n{PURPOSE}it is linked.\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n\nNo reason given.\n")
    assert docs_problems(tmp_path) == [
        "docs/b.md does not open with '# Title', '', 'Why this page: ...'",
        "docs/b.md is not linked from the README",
        "the README links docs/gone.md, which does not exist",
    ]
