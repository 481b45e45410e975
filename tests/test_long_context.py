"""More positions than the preset: train.py --block-size above the preset's context.

GPT-2's 1,024 positions are a learned table (wpe), GPT-2's choice and not a limit of
the model, so a long-context run (recipes/long-context.toml) sizes wpe to
--block-size: from scratch every row starts from the init and trains; with
--init-from the checkpoint's rows come first and the rows beyond them keep the init;
under LoRA (wpe frozen) that would leave them untrained forever, a one-line error.
The checkpoint and GPT-2-token data are tests/test_finetune.py's (tiny's shape, 64
positions; the tiny preset has 32)."""

import importlib
import json

import pytest
import torch

from support.train.command_line import parse_args
from support.train.grid import Grid
from tests.distributed import run_ranks
from tests.test_finetune import FLAGS, checkpoint, gpt2_data  # noqa: F401 - fixtures

train = importlib.import_module("train")
model_lib = importlib.import_module("02_model")


def built_wpe(argv) -> tuple[torch.Tensor, object]:
    """The wpe train.py builds for these flags on one process, before any step:
    validate's checks (which print the positions line), then build_chunks."""
    cfg, _ = parse_args(argv)
    gpt_config = train.validate(cfg, 1)
    chunks = train.build_chunks(cfg, gpt_config, Grid(), torch.device("cpu"))
    return chunks[0].transformer.wpe.weight.detach().clone(), gpt_config


def test_a_run_trains_more_positions_than_its_preset(
    gpt2_data,  # noqa: F811
    tmp_path,
    capsys,
):
    """tiny has 32 positions; --block-size 128 trains 128. The run opens with the
    positions line, the exported model has 128 rows of wpe, and after one step
    without weight decay (so a row moves only if its position had a gradient) every
    row moved off the init: each sequence covers positions 0..127. A prompt longer
    than 128 tokens samples (cropped). Catches check_block_size refusing the run (the
    old cap), validate cutting wpe to the preset's 32, and the loader reading windows
    of 32."""
    out = tmp_path / "scratch"
    argv = FLAGS + [
        "--data-dir",
        gpt2_data,
        "--out-dir",
        str(out),
        "--block-size",
        "128",
    ]
    init, gpt_config = built_wpe(argv)
    assert gpt_config.block_size == 128 and init.shape[0] == 128
    train.main(argv + ["--weight-decay", "0"])
    said = capsys.readouterr().out
    assert "positions: 128 (the preset has 32)" in said, said
    model, blob = train.load_exported(out / "model.pt")
    assert blob["model_config"]["block_size"] == 128
    trained = model.transformer.wpe.weight.detach()
    assert trained.shape == init.shape
    moved = (trained - init).abs().amax(dim=1)  # Each row's largest change.
    # AdamW's first step moves every coordinate with a gradient by about lr/warmup =
    # 6e-5; a row without one would move by exactly 0.
    assert bool((moved > 1e-6).all()), f"rows left at the init: {(moved <= 1e-6).sum()}"
    text = train.sample(out / "model.pt", "def f(x):\n    return x\n" * 40, 4)
    assert text.startswith("def f(x)")


def test_init_from_a_shorter_checkpoint_copies_its_rows_first(
    gpt2_data,  # noqa: F811
    checkpoint,  # noqa: F811
    tmp_path,
    capsys,
):
    """--block-size 128 from a 64-position checkpoint: wpe rows 0..63 are the
    checkpoint's, exactly, and rows 64..127 are the init a run from scratch gives
    (same seed, same shape), exactly. Every other tensor comes from the checkpoint as
    before (tests/test_finetune.py). Catches check_init_from refusing a shorter
    checkpoint (the old rule), the copy skipping wpe, and the rows beyond being
    zeroed or tiled."""
    flags = FLAGS + ["--data-dir", gpt2_data, "--out-dir", str(tmp_path)]
    grown, _ = built_wpe(flags + ["--block-size", "128", "--init-from", checkpoint])
    said = capsys.readouterr().out
    grew = "positions: 128 (the preset has 32): wpe's first rows from --init-from"
    fewer = "--init-from has 64 of the model's 128 positions: wpe's rows 64+ start"
    assert grew in said and fewer in said, said
    scratch, _ = built_wpe(flags + ["--block-size", "128"])
    want = model_lib.GPT.load_pretrained(checkpoint).transformer.wpe.weight.detach()
    assert want.shape[0] == 64
    assert torch.equal(grown[:64], want)
    assert torch.equal(grown[64:], scratch[64:])
    assert not torch.equal(scratch[:64], want)  # The checkpoint is not the init.


def test_lora_on_a_shorter_checkpoint_is_one_line(
    gpt2_data,  # noqa: F811
    checkpoint,  # noqa: F811
    tmp_path,
):
    """LoRA freezes wpe, so rows beyond the checkpoint's 64 would never train: a
    one-line error before anything starts. At --block-size 64 the same LoRA run is
    fine."""
    flags = FLAGS + ["--data-dir", gpt2_data, "--out-dir", str(tmp_path)]
    lora = flags + ["--init-from", checkpoint, "--lora-rank", "2"]
    with pytest.raises(SystemExit) as e:
        train.main(lora + ["--block-size", "128"])
    message = str(e.value)
    assert "\n" not in message
    assert "has 64 positions; --lora-rank freezes wpe, so positions 64..127" in message
    cfg, _ = parse_args(lora + ["--block-size", "64"])
    assert train.validate(cfg, 1).block_size == 64


def _grown_cp2(rank, world, argv):
    train.main(argv)


def test_grown_positions_under_cp2_equal_one_process(gpt2_data, tmp_path):  # noqa: F811
    """The recipe's combination: 08's ring at cp 2 over 128 positions of a
    32-position preset. Each rank looks wpe up at its zigzag chunks' true positions,
    rows 0..127, so two steps' losses and the exported wpe equal one process's. fp32,
    the same sums in another order (the loss's shares, the gradients' average over 2
    ranks): 1e-5 relative. Catches a CP lookup bounded by the preset's context, or
    positions taken modulo it."""
    argv = FLAGS + ["--data-dir", gpt2_data, "--block-size", "128", "--max-steps", "2"]
    one = tmp_path / "one"
    two = tmp_path / "cp2"
    train.main(argv + ["--out-dir", str(one)])
    run_ranks(_grown_cp2, 2, argv + ["--cp", "2", "--out-dir", str(two)], timeout=300)
    curves = []
    for d in (one, two):
        rows = map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
        curves.append([r.get("loss", r.get("val_loss")) for r in rows])
    assert len(curves[0]) == 3  # Two steps and the last evaluation.
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-5, atol=0)
    wpe = [
        train.load_exported(d / "model.pt")[0].transformer.wpe.weight
        for d in (one, two)
    ]
    assert wpe[1].shape[0] == 128
    torch.testing.assert_close(wpe[1], wpe[0], rtol=1e-5, atol=1e-7)


def test_09s_seq_len_sizes_wpe_as_train_py_does(monkeypatch, capsys):
    """09_plan.py --seq-len 65536 plans GPT-2 medium with 65,536 rows of wpe, as
    train.py --block-size builds it: 64 x 1,024 more position parameters than the
    preset's 1,024 rows (the model's config handed to 09's search is checked)."""
    plan_lib = importlib.import_module("09_plan")
    seen = []

    def search(config, *args):
        seen.append(config)
        return []  # No layouts: 09 then exits with its one-line error.

    monkeypatch.setattr(plan_lib, "search", search)
    argv = ["--model", "gpt2-medium", "--gpus", "8", "--seq-len", "65536"]
    with pytest.raises(SystemExit):
        plan_lib.main(argv)
    assert "no layout of gpt2-medium" in capsys.readouterr().err
    assert [c.block_size for c in seen] == [65536]
