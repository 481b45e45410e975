"""train.py's command line: TrainConfig's fields as flags, and --config FILE's recipe
read under them (argparse keeps the last of a repeated flag, so the command line wins).

Here, not in config.py: a recipe is checked against TrainConfig (support/train/recipe
imports config), and the command line reads recipes, so config imports neither.
"""

import argparse
import sys
from dataclasses import fields

from support.train import recipe
from support.train.config import DEFAULT_DATA, ConfigError, TrainConfig, flag_name


def recipe_argv(argv: list[str]) -> tuple[list[str], dict]:
    """--config FILE's settings as flags put before the others (argparse keeps the last
    of a repeated flag, so the command line wins), and the recipe's [plan] table."""
    path, rest = recipe.split_config_flag(argv)
    if path is None:
        return argv, {}
    values, planned = recipe.load(path)
    return recipe.to_argv(values) + rest, planned


def parse_args(argv=None, description: str = "train.py", choices: dict | None = None):
    """TrainConfig's fields as flags, the one-shot --export, --sample and --plan, and
    --config FILE, a recipe whose settings the other flags override.

    `choices` maps a field to the values a lesson allows (02's presets for "model"), so
    that its help lists them. Returns (cfg, args): the TrainConfig, and argparse's
    namespace for the others (with gpus_per_node: the recipe's [plan], else 8). A bad
    recipe exits with one line.
    """
    choices = choices or {}
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=description, formatter_class=formatter)
    for f in fields(TrainConfig):
        # --no-compile too: a flag turns off what a --config recipe turned on.
        on_off = {"action": argparse.BooleanOptionalAction}
        kind = on_off if f.type is bool else {"type": f.type}
        help = f.metadata["help"]
        if f.name in choices:
            help = f"{help}: {', '.join(choices[f.name])}"
        parser.add_argument(flag_name(f.name), default=f.default, help=help, **kind)
    export = "merge RUN_DIR's newest checkpoint into RUN_DIR/model.pt, then exit"
    parser.add_argument("--export", metavar="RUN_DIR", help=export)
    sample = "sample from an exported model, then exit"
    parser.add_argument("--sample", metavar="MODEL_PT", help=sample)
    parser.add_argument("--prompt", default="def ", help="the prompt for --sample")
    config = "a TOML recipe (recipes/) of settings; flags given here override it"
    parser.add_argument("--config", metavar="FILE", help=config)
    plan = "print 09_plan.py's plan of these settings and exit: no process starts"
    parser.add_argument("--plan", action="store_true", help=plan)
    gpus = "--plan's GPU, h100, h200, a100 or cpu; empty: the recipe's, else this machine's"
    parser.add_argument("--plan-gpu", default="", metavar="GPU", help=gpus)
    argv = sys.argv[1:] if argv is None else list(argv)
    planned = {}  # The recipe's [plan] table: the GPU 09 plans it for.
    try:
        argv, planned = recipe_argv(argv)
    except ConfigError as e:  # A RecipeError: one line, before anything starts.
        parser.exit(2, f"train.py: error: {e}\n")  # As train.py's other errors.
    args = parser.parse_args(argv)
    args.plan_gpu = args.plan_gpu or planned.get("gpu", "")
    args.gpus_per_node = planned.get("gpus_per_node", 8)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    # An empty --data-dir means the default data of --tokenizer ("" for an unknown one,
    # which check_flags reports).
    cfg.data_dir = cfg.data_dir or DEFAULT_DATA.get(cfg.tokenizer or "bpe", "")
    named = any(a == "--model" or a.startswith("--model=") for a in argv)
    if cfg.init_from and not named:  # The checkpoint's shape: validate reads it.
        cfg.model = ""
    return cfg, args
