"""Any GPT shape in train.py (issue 42): --n-layer, --n-head, --n-embd, --vocab-size and
--block-size over --model's preset, from the command line or a recipe's keys.

The shape here is none of 02's presets: 3 blocks of width 24 in 3 heads (8 dims each),
a vocabulary of 300 rows over the data's 257 ids, T = 16. The run says its shape, builds
and trains that model, records it in its checkpoints and model.pt, resumes it bit for
bit, and refuses (one line naming the flags) a resume of another shape and every shape
02 or 04 could not build.
"""

import importlib
import json
import shutil
from pathlib import Path

import pytest

from support.train import recipe
from support.train.command_line import parse_args
from support.train.config import ConfigError

train = importlib.import_module("train")
data = importlib.import_module("01_data")

SHAPE = {"n_layer": 3, "n_head": 3, "n_embd": 24, "vocab_size": 300, "block_size": 16}
FLAGS = ["--model", "tiny"] + [
    a for k, v in SHAPE.items() for a in ("--" + k.replace("_", "-"), str(v))
]
# 4 steps of 4 sequences, a checkpoint every 2, fp32: bit-exact on a CPU.
RUN = ["--batch-size", "4", "--micro-batch-size", "2", "--max-steps", "4",
       "--warmup-steps", "2", "--log-interval", "1", "--eval-interval", "0",
       "--eval-steps", "1", "--ckpt-interval", "2", "--sample-tokens", "0",
       "--dtype", "fp32"]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A char-level corpus of pseudo-code: 257 ids (256 bytes and the end of text)."""
    root = tmp_path_factory.mktemp("shape-data")
    src = root / "src"
    src.mkdir()
    for d in range(10):
        lines = [f"def f{d}_{i}(x):\n    return x * {i} + {d}\n" for i in range(120)]
        (src / f"doc{d}.py").write_text("".join(lines))
    data.prepare(str(src), "char", root / "data", block_size=16)
    return str(root / "data")


def rows(out_dir) -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """The custom shape trained 4 steps in one go, sampling 60 tokens at the end: (its
    folder, what it printed)."""
    out = tmp_path_factory.mktemp("straight")
    argv = FLAGS + RUN + ["--data-dir", data_dir, "--out-dir", str(out)]
    printed = []  # rank 0's lines: the run's first ones are support/train/run.describe's
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train.distributed, "print0", lambda *a: printed.extend(a))
        train.main(argv + ["--sample-tokens", "60"])
    return out, "\n".join(printed)


def test_train_py_trains_the_shape_it_is_given(straight):
    """Its first lines name the shape; its checkpoint's model_config and model.pt hold
    it, and model.pt rebuilds that model: 3 blocks, q|k|v of 3·24 rows, wte of 300 rows
    padded to 320 (a multiple of 64), wpe of 16. The 43 rows past the tokenizer's ids
    are never sampled (a char tokenizer cannot decode them), and 4 steps lower the
    loss."""
    out, printed = straight
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    assert f"model: {shape}" in printed
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    saved = json.loads((ckpt / "meta.json").read_text())["model_config"]
    assert {k: saved[k] for k in SHAPE} == SHAPE
    model, blob = train.load_exported(out / "model.pt")
    assert {k: getattr(model.config, k) for k in SHAPE} == SHAPE
    t = model.transformer
    assert len(t.h) == 3 and t.h[0].attn.c_attn.weight.shape == (72, 24)
    assert t.wte.weight.shape == (320, 24) and t.wpe.weight.shape == (16, 24)
    tokenizer = data.get_tokenizer("char")
    text = train.sample(out / "model.pt", "def ", 200, seed=1)  # decodes, or raises
    assert text.startswith("def ") and tokenizer.n_vocab == 257
    losses = [r["loss"] for r in rows(out)]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_a_custom_shape_resumes_bit_for_bit(straight, data_dir, tmp_path):
    """Stopped after 2 steps (its checkpoint) and resumed with the same flags: the same
    4 losses and gradient norms as the straight run, exactly (fp32 on a CPU, the same
    kernels in the same order)."""
    argv = FLAGS + RUN + ["--data-dir", data_dir, "--out-dir", str(tmp_path)]
    train.main(argv + ["--steps-this-run", "2"])
    train.main(argv + ["--resume"])
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in rows(tmp_path)]
    want = [(r["step"], r["loss"], r["grad_norm"]) for r in rows(straight[0])]
    assert got == want


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n-embd", "48"], "holds --n-embd 24, this run --n-embd 48: resume with the same"),
        (["--n-layer", "2", "--n-head", "4"],
         "holds --n-layer 3, --n-head 3, this run --n-layer 2, --n-head 4: resume"),
        (["--vocab-size", "0"], "holds --vocab-size 300, this run --vocab-size 257: resume"),
    ],
    ids=["width", "layers-and-heads", "vocabulary-of-the-data"],
)  # fmt: skip
def test_a_resume_of_another_shape_is_one_line_naming_the_flags(
    straight, data_dir, tmp_path, argv, message
):
    """Before any process group: the newest checkpoint's model_config against this
    run's model (without the check, the shards meet the model in the restore)."""
    out = tmp_path / "run"
    shutil.copytree(straight[0], out)
    run = FLAGS + RUN + ["--data-dir", data_dir, "--out-dir", str(out), "--resume"]
    cfg, _ = parse_args(run + argv)
    with pytest.raises(ConfigError) as err:
        train.validate(cfg, 1)
    assert message in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--n-head", "5"], 1,
         "--n-embd 24 does not split into --n-head 5 heads: the width must be a multiple"),
        (["--n-embd", "0"], 1, "--n-embd 32 (--model tiny's) does not split into --n-head 3"),
        (["--tp", "2"], 2, "--tp 2 does not divide --n-head 3: a TP rank holds whole heads"),
        (["--vocab-size", "100"], 1,
         "--vocab-size 100: the tokenizer of --data-dir DATA writes 257 ids; use at least"),
        (["--n-head", "-1"], 1, "--n-head must be >= 0, got -1"),
        (["--pp", "4"], 4, "--n-layer 3: n_layer=3 blocks cannot fill"),
        (["--cp", "3"], 3, "--block-size 16: --cp 3 cuts a sequence in 6 chunks"),
    ],
    ids=["heads-width", "heads-preset-width", "tp-heads", "vocab-below-data",
         "negative", "pp-layers", "cp-context"],
)  # fmt: skip
def test_a_shape_that_cannot_be_built_is_one_line_naming_the_flags(
    data_dir, argv, world, message
):
    """02 needs C a multiple of nh; 04 whole heads on a TP rank; the data's ids must
    have rows; 05 a block a stage; 08 2·cp chunks of T. "DATA": the data folder."""
    cfg, _ = parse_args(FLAGS + RUN + ["--data-dir", data_dir] + argv)
    with pytest.raises(ConfigError) as err:
        train.validate(cfg, world)
    message = message.replace("DATA", data_dir)
    assert message in str(err.value) and "\n" not in str(err.value), err.value


def test_help_explains_each_shape_flag(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for part in (
        "--n-layer N_LAYER number of blocks, L; 0: the preset's",
        "--n-head N_HEAD attention heads, nh (--tp must divide it); 0: the preset's",
        "--n-embd N_EMBD the width C, a multiple of nh; 0: the preset's",
        "--vocab-size VOCAB_SIZE rows of wte, V (then padded to 64·tp); 0: the data's",
        "--block-size BLOCK_SIZE tokens per sequence, the model's context; 0: the preset's",
    ):
        assert part in text, part


def test_a_recipe_with_the_shape_keys_builds_and_plans_that_shape(
    data_dir, tmp_path, capsys
):
    """[model] n_layer, n_head, n_embd, vocab_size and [batch] block_size: the recipe
    loads (each key in its table, of its type), train.py builds that model, --plan
    prints its shape, and a run's config.toml writes the keys back."""
    text = "\n".join(
        [
            "[model]",
            'model = "tiny"',
            *(f"{k} = {v}" for k, v in SHAPE.items() if k != "block_size"),
            "[batch]",
            f"block_size = {SHAPE['block_size']}",
            "batch_size = 4",
            "micro_batch_size = 2",
        ]
    )
    path = tmp_path / "shape.toml"
    path.write_text(text)
    cfg, _ = parse_args(["--config", str(path), "--data-dir", data_dir])
    gpt_config = train.validate(cfg, 1)
    assert {k: getattr(gpt_config, k) for k in SHAPE} == SHAPE
    train.main(
        ["--config", str(path), "--data-dir", data_dir, "--plan", "--plan-gpu", "cpu"]
    )
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    assert f"model: {shape}" in capsys.readouterr().out
    written = recipe.write(cfg, tmp_path / "config.toml")
    values, _ = recipe.load(written)
    assert {k: values[k] for k in SHAPE} == SHAPE
    assert (
        '[model]\nmodel = "tiny"\nn_layer = 3\nn_head = 3\nn_embd = 24\nvocab_size = 300'
        in (written.read_text())
    )
    path.write_text(text.replace("n_head = 3", 'n_head = "3"'))
    with pytest.raises(
        recipe.RecipeError, match=r"\[model\] n_head: expected int, got str"
    ):
        recipe.load(path)
