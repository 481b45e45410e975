"""train.py --schedule zb1 (05c's B/W split under 05b's ZB-H1 table): the same loss and
gradient-norm curve as one process (test_train's reference: the whole batch of 8 as one
microbatch, fp32, global-norm clipping at the default 1.0), with accumulation (m = 4
microbatches of 2), with ZeRO-1 and 2 and with TP; bf16 follows 1F1B's bf16 curve (the
split casts as autocast does, measured equal); and each flag it does not support is one
line that says why, before any process group exists."""

import pytest
import torch

from support.train.command_line import parse_args
from tests.distributed import run_ranks
from tests.test_train import (  # noqa: F401 - fixtures: data_dir, reference
    BASE,
    _train_configs,
    assert_same_curve,
    data_dir,
    metrics,
    reference,
    train,
)

PP2 = ["--pp", "2", "--micro-batch-size", "2", "--schedule", "zb1"]
EVAL = ["--eval-interval", "2"]  # evaluates at steps 0, 2 and the end (3)


def _train_and_val(rank, world, data, tmp, configs):
    """train.main once per config in one spawned world; rank 0: (train, val) rows."""
    out = []
    for name, extra in configs:
        out_dir = f"{tmp}/{name}"
        train.main(BASE + EVAL + ["--data-dir", data, "--out-dir", out_dir] + extra)
        torch.distributed.barrier()
        out.append((metrics(out_dir), metrics(out_dir, "val")) if rank == 0 else None)
    return out


def test_zb1_on_4_stages_trains_and_evaluates_as_one_process(data_dir, tmp_path):  # noqa: F811
    """pp 4 (one of the 4 blocks a stage), m = 4 and 8: the loss, grad-norm and
    validation curves of one process (the batch of 8 as one microbatch), within
    assert_same_curve's fp32 rounding tolerance."""
    ref = tmp_path / "one-process"
    one = ["--micro-batch-size", "8", "--data-dir", data_dir, "--out-dir", str(ref)]
    train.main(BASE + EVAL + one)
    ref_rows = (metrics(ref), metrics(ref, "val"))
    pp4 = ["--pp", "4", "--schedule", "zb1"]
    configs = [
        ("pp4-zb1-m4", pp4 + ["--micro-batch-size", "2"]),
        ("pp4-zb1-m8", pp4 + ["--micro-batch-size", "1"]),
    ]
    results = run_ranks(
        _train_and_val, 4, data_dir, str(tmp_path), configs, timeout=600
    )
    assert [r["step"] for r in ref_rows[1]] == [0, 2, 3]
    for (name, _), (rows, val) in zip(configs, results[0]):
        assert_same_curve(rows, ref_rows[0], name)
        as_curve = [
            [{"step": r["step"], "loss": r["val_loss"], "grad_norm": 0} for r in v]
            for v in (val, ref_rows[1])
        ]
        assert_same_curve(*as_curve, f"{name}, evaluation")


def test_zb1_on_2_ranks_follows_one_process(data_dir, tmp_path, reference):  # noqa: F811
    configs = [
        ("pp2-zb1", PP2),
        ("pp2-zb1-bf16", PP2 + ["--dtype", "bf16"]),
        ("pp2-1f1b-bf16", PP2[:-1] + ["1f1b", "--dtype", "bf16"]),
    ]
    results = run_ranks(
        _train_configs, 2, data_dir, str(tmp_path), configs, timeout=300
    )
    got = dict(zip((name for name, _ in configs), results[0]))
    assert_same_curve(got["pp2-zb1"], reference, "pp2-zb1")
    for key in ("loss", "grad_norm"):  # bf16: zb1's curve is 1F1B's (measured equal)
        zb1 = torch.tensor([r[key] for r in got["pp2-zb1-bf16"]])
        one_f = torch.tensor([r[key] for r in got["pp2-1f1b-bf16"]])
        torch.testing.assert_close(zb1, one_f, rtol=1e-4, atol=1e-5)


def test_zb1_with_zero_and_tp_on_4_ranks(data_dir, tmp_path, reference):  # noqa: F811
    """dp 2 x pp 2 under ZeRO-1 and ZeRO-2 (whose gradient hooks fire in W, and sync in
    each chunk's last W), and tp 2 x pp 2 (04's shards split too: their F.linear)."""
    dp2 = ["--dp", "2", "--micro-batch-size", "1", "--pp", "2", "--schedule", "zb1"]
    configs = [
        ("dp2-pp2-zero1-zb1", dp2 + ["--zero", "1"]),
        ("dp2-pp2-zero2-zb1", dp2 + ["--zero", "2"]),
        ("tp2-pp2-zb1", ["--tp", "2"] + PP2),
    ]
    results = run_ranks(
        _train_configs, 4, data_dir, str(tmp_path), configs, timeout=300
    )
    for (name, _), got in zip(configs, results[0]):
        assert_same_curve(got, reference, name)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            ["--schedule", "zb1"],
            1,
            "--schedule zb1 splits PP's backward, but --pp is 1",
        ),
        (PP2 + ["--dtype", "fp16"], 2, "--dtype fp16 with --schedule zb1: 06's loss"),
        (
            PP2 + ["--recompute", "full"],
            2,
            "--recompute with --schedule zb1: a block's",
        ),
        (PP2 + ["--lora-rank", "4"], 2, "--lora-rank with --schedule zb1: LoRA's"),
        (PP2 + ["--loss", "chunked"], 2, "--loss chunked with --schedule zb1: 06b's"),
        (PP2 + ["--compile"], 2, "--compile with --schedule zb1: torch.compile"),
        (PP2 + ["--virtual-stages", "2"], 2, "needs schedule='interleaved'"),
        (
            PP2 + ["--tp", "2", "--sequence-parallel"],
            4,
            "--sequence-parallel with --schedule zb1: W would keep",
        ),
        (
            PP2
            + ["--dp", "2", "--micro-batch-size", "1", "--grad-compression", "fp16"],
            4,
            "--grad-compression with --schedule zb1: 03b's hooks",
        ),
    ],
    ids=[
        "pp1",
        "fp16",
        "recompute",
        "lora",
        "chunked",
        "compile",
        "virtual",
        "sp",
        "compression",
    ],
)
def test_unsupported_flags_fail_with_one_line(data_dir, argv, world, message):  # noqa: F811
    cfg, _ = parse_args(BASE + ["--data-dir", data_dir] + argv)
    with pytest.raises(train.ConfigError) as err:
        train.validate(cfg, world)
    assert message in str(err.value) and "\n" not in str(err.value)
