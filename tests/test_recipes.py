"""Recipes (support/train/recipe.py, recipes/*.toml): every recipe parses, validates against
train.py's TrainConfig and fits the GPU its [plan] names by 09's plan; `base =` and the
command line override in that order; bad files are one-line errors naming file and key;
the resolved settings write back as TOML. cpu-demo.toml runs through train.py --config
in tests/test_train_plan.py.
"""

import importlib
from pathlib import Path

import pytest

from support.train import recipe
from support.train.command_line import parse_args
from support.train.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
plan_lib = importlib.import_module("09_plan")
train = importlib.import_module("train")


def test_the_recipes_folder_holds_the_six_recipes():
    names = {p.name for p in RECIPES}
    want = {"cpu-demo", "gpt2-124m-1gpu", "gpt2-124m-8gpu", "gpt2-xl-16gpu"}
    want |= {"finetune-lora", "long-context"}
    assert {f"{n}.toml" for n in want} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses_validates_and_fits_its_gpu(path):
    """Each recipe as `train.py --config FILE --plan` takes it: train.py's own checks
    and model (validate, plan=True: the vocabulary of its tokenizer, padded; wpe of
    --block-size rows), then 09's plan on the recipe's GPU. Catches a recipe train.py
    refuses (long-context.toml's 65,536 positions under the old cap of the preset's
    1,024) and one that does not fit."""
    values, plan = recipe.load(path)
    cfg = TrainConfig(**values)  # every key a field, every value of its type
    text = path.read_text()
    assert text.startswith("# "), f"{path.name} opens with its comment"
    for part in ("Launch:", "Needs:", "Predicted by 09", "Measured:"):
        assert part in text, f"{path.name}'s comment says nothing under {part!r}"
    cfg, args = parse_args(["--config", str(path), "--plan"])
    world = cfg.dp * cfg.cp * cfg.tp * cfg.pp
    gpt_config = train.validate(cfg, world, plan=True)
    preset = plan_lib.model_config(cfg.model)
    assert gpt_config.block_size == (cfg.block_size or preset.block_size)
    p = plan_lib.plan_run(cfg, gpt_config, args.plan_gpu, args.gpus_per_node)
    assert p.fits, f"{path.name}: {p.memory['total'] / 2**30:.1f} GiB > {p.capacity}"


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_base_is_overridden_by_the_file_and_the_file_by_the_command_line(tmp_path):
    (tmp_path / "sub").mkdir()
    write(
        tmp_path,
        "base.toml",
        "[optimizer]\nlr = 0.01\nmax_steps = 7\n[run]\nseed = 3\n",
    )
    child = write(
        tmp_path / "sub",
        "child.toml",
        'base = "../base.toml"\n[optimizer]\nlr = 0.02\n',
    )
    values, _ = recipe.load(child)
    assert values == {"lr": 0.02, "max_steps": 7, "seed": 3}  # the file over its base
    assert recipe.merge({"lr": 1, "seed": 2}, {"lr": 3}) == {"lr": 3, "seed": 2}
    cfg, _ = parse_args(recipe.recipe_to_argv(child) + ["--lr", "0.5"])
    assert (cfg.lr, cfg.max_steps, cfg.seed) == (0.5, 7, 3)  # the flag over the file
    on = write(tmp_path, "on.toml", f'base = "{child}"\n[model]\ncompile = true\n')
    assert parse_args(["--config", str(on)])[0].compile  # a bool the file turns on
    cfg, _ = parse_args(["--config", str(on), "--no-compile", "--seed", "4"])
    assert (cfg.compile, cfg.seed, cfg.lr) == (False, 4, 0.02)  # the flags turn it off
    path, rest = recipe.split_config_flag(
        ["--dp", "2", "--config", "x.toml", "--lr", "1"]
    )
    assert (path, rest) == ("x.toml", ["--dp", "2", "--lr", "1"])


BAD = {
    "unknown key": (
        "[optimizer]\nlearning_rate = 0.1\n",
        "[optimizer] learning_rate: unknown",
    ),
    "wrong type": (
        '[batch]\nbatch_size = "32"\n',
        "[batch] batch_size: expected int, got str",
    ),
    "bool as int": ("[layout]\ndp = true\n", "[layout] dp: expected int, got bool"),
    "wrong table": ("[run]\nlr = 0.1\n", "[run] lr: belongs in [optimizer]"),
    "unknown table": ("[training]\nlr = 0.1\n", "[training]: unknown table"),
    "malformed": ("[optimizer\nlr = 0.1\n", "malformed TOML"),
    "out of range": ("[batch]\nbatch_size = 0\n", "--batch-size must be > 0, got 0"),
    "plan key": ('[plan]\ngpu = "h100"\nnodes = 2\n', "[plan] nodes: unknown"),
    "missing base": ('base = "nowhere.toml"\n', "nowhere.toml: cannot read"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_recipe_is_one_line_naming_the_file_and_key(tmp_path, case):
    text, expected = BAD[case]
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(recipe.RecipeError) as raised:
        recipe.load(path)
    message = str(raised.value)
    assert "\n" not in message and expected in message, message
    assert "bad.toml" in message or "nowhere.toml" in message, message


def test_settings_write_back_as_toml_and_load_the_same(tmp_path):
    cfg = TrainConfig(lr=0.25, compile=True, out_dir='out/"quoted"', model="gpt2")
    path = recipe.write(cfg, tmp_path / "config.toml")
    values, _ = recipe.load(path)
    assert TrainConfig(**values) == cfg
    assert "[optimizer]\n" in path.read_text() and "lr = 0.25" in path.read_text()
