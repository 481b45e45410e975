"""Run recipes as TOML files: train.py's own settings, to share, review and rerun.

A recipe's keys are TrainConfig's fields (`batch_size` is `--batch-size`), grouped in
the tables of GROUPS. `base = "other.toml"` (relative to the file) is read first and
overridden by the file; a flag on the command line overrides both (recipe_to_argv puts
the file's flags first, and argparse keeps the last of a repeated flag). An optional
[plan] table names the GPU 09_plan.py should plan the recipe for. An unknown key, a
wrong type, a bad number or a malformed file is a RecipeError, one line naming the
file, the key and what was expected, raised before any process starts.

    [layout]               [batch]              [model]        [optimizer]     [run]
    dp tp pp schedule ...  batch_size ...       model n_layer  lr max_steps    out_dir ...
                           block_size           n_head ...

Run as a script: `python -m support.train.recipe FILE` prints the resolved settings as TOML,
`--argv FILE` them as train.py's flags.
"""

import sys
import tomllib
from dataclasses import fields
from pathlib import Path

from support.files import atomic_write
from support.train.config import ConfigError, TrainConfig, check_numbers, flag_name

# train.py's settings by table, in TrainConfig's order; a field not listed (a flag
# added later) belongs to [run].
GROUPS = {
    "layout": (
        "dp tp pp cp schedule virtual_stages sequence_parallel zero grad_compression "
        "powersgd_rank powersgd_warmup_steps"
    ).split(),
    "batch": "batch_size micro_batch_size block_size".split(),
    "model": (
        "model n_layer n_head n_embd vocab_size init_from lora_rank lora_alpha dropout "
        "recompute loss dtype compile"
    ).split(),
    "optimizer": (
        "max_steps lr warmup_steps lr_schedule min_lr decay_fraction cycle_steps "
        "weight_decay grad_clip"
    ).split(),
}
# 09_plan.py's keys: the GPU a recipe is planned for, and how many share a node.
PLAN_KEYS = {"gpu": str, "gpus_per_node": int}


class RecipeError(ConfigError):
    """A bad recipe: one line naming the file and the key."""


def table_of(name: str) -> str:
    """The table a TrainConfig field belongs in."""
    return next((t for t, names in GROUPS.items() if name in names), "run")


def _types() -> dict:
    return {f.name: f.type for f in fields(TrainConfig)}


def _check(path, table: str, key: str, value, kind):
    """value as kind (an int is a fine float), or RecipeError naming file and key."""
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:  # subtle: True is an int to isinstance, not here
        got = f"{type(value).__name__} {value!r}"
        raise RecipeError(
            f"{path}: [{table}] {key}: expected {kind.__name__}, got {got}"
        )
    return value


def read(path) -> tuple[dict, dict]:
    """One file, no base: -> (TrainConfig values, [plan] values), checked."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: malformed TOML: {e}") from None
    types = _types()
    values = {}
    plan = {}
    for table, body in data.items():
        if table == "base":
            continue
        where = f"{path}: [{table}]"
        if not isinstance(body, dict):
            tables = ", ".join([*GROUPS, "run", "plan"])
            raise RecipeError(f"{path}: {table}: expected a table ({tables}) or base")
        if table == "plan":
            for key, value in body.items():
                if key not in PLAN_KEYS:
                    raise RecipeError(
                        f"{where} {key}: unknown; expected gpu, gpus_per_node"
                    )
                plan[key] = _check(path, table, key, value, PLAN_KEYS[key])
            continue
        if table not in (*GROUPS, "run"):
            raise RecipeError(
                f"{where}: unknown table; expected {', '.join(GROUPS)}, run"
            )
        for key, value in body.items():
            if key not in types:
                raise RecipeError(f"{where} {key}: unknown; not a train.py setting")
            if table_of(key) != table:
                raise RecipeError(f"{where} {key}: belongs in [{table_of(key)}]")
            values[key] = _check(path, table, key, value, types[key])
    return values, plan


def merge(base: dict, override: dict) -> dict:
    """A recipe over its base: every key of override wins."""
    return {**base, **override}


def load(path, _seen=()) -> tuple[dict, dict]:
    """A recipe with its bases resolved: -> (TrainConfig values, [plan] values).
    The values are checked as train.py checks numbers (support/train/config.check_numbers)."""
    path = Path(path).resolve()
    if path in _seen:
        raise RecipeError(f"{path}: base: a cycle through {_seen[-1].name}")
    values, plan = read(path)
    base = tomllib.loads(path.read_text()).get("base")
    if base is not None:
        if not isinstance(base, str):
            raise RecipeError(f"{path}: base: expected a file name, got {base!r}")
        base_values, base_plan = load(path.parent / base, (*_seen, path))
        values = merge(base_values, values)
        plan = merge(base_plan, plan)
    if not _seen:  # the whole recipe, as train.py would see it without flags
        try:
            check_numbers(TrainConfig(**values))
        except ConfigError as e:
            raise RecipeError(f"{path}: {e}") from None
    return values, plan


def to_argv(values: dict) -> list[str]:
    """TrainConfig values as train.py's flags (a bool as --compile or --no-compile)."""
    argv = []
    for key, value in values.items():
        if isinstance(value, bool):
            argv.append(flag_name(key) if value else "--no-" + flag_name(key)[2:])
        else:
            argv += [flag_name(key), str(value)]
    return argv


def recipe_to_argv(path) -> list[str]:
    """The recipe as train.py's flags: parse_args(recipe_to_argv(path) + argv) lets the
    command line win (train.py --config FILE does this: support/train/command_line.recipe_argv)."""
    return to_argv(load(path)[0])


def split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--config's FILE or None, the other arguments): train.py's first step."""
    rest = list(argv)
    for i, arg in enumerate(rest):
        if arg == "--config" and i + 1 < len(rest):
            return rest[i + 1], rest[:i] + rest[i + 2 :]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], rest[:i] + rest[i + 1 :]
    return None, rest


def _toml_value(value) -> str:
    """A str, int, float or bool in TOML (flat values only: all TrainConfig has)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a TOML value")


def dumps(values: dict, plan: dict | None = None) -> str:
    """values (TrainConfig fields) as a recipe, by table; loads back to the same."""
    lines = []
    tables = {}
    for key, value in values.items():
        tables.setdefault(table_of(key), []).append((key, value))
    if plan:
        tables["plan"] = list(plan.items())
    for table in [*GROUPS, "run", "plan"]:
        if table in tables:
            lines.append(f"[{table}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in tables[table]]
            lines.append("")
    return "\n".join(lines)


def write(cfg: TrainConfig, path) -> Path:
    """Every setting of a run, resolved, to path (OUT/config.toml): rerun it with
    `train.py --config OUT/config.toml`."""
    path = Path(path)
    values = {f.name: getattr(cfg, f.name) for f in fields(TrainConfig)}
    text = "# The resolved settings of this run.\n" + dumps(values)
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


if __name__ == "__main__":  # python -m support.train.recipe [--argv] FILE
    try:
        if sys.argv[1] == "--argv":  # the flags train.py --config FILE reads
            print(" ".join(recipe_to_argv(sys.argv[2])))
        else:
            print(dumps(*load(sys.argv[1])))
    except RecipeError as e:
        sys.exit(f"error: {e}")
