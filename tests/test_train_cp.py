"""train.py --cp: context parallelism (08) in the 4D grid trains like one process.

Every layout below runs the same 4 steps as one process (test_train's BASE: the tiny
GPT, 4 layers, 8 sequences of 32 tokens a step, fp32) and must give its loss curve,
gradient norms and validation loss, each CP rank holding 2 of the 2·cp zigzag chunks of
every sequence. One world is spawned per world size; every layout runs inside it.
"""

import functools
import importlib
import re
import types

import pytest
import torch
import torch.distributed as dist

from support import run_log
from tests import test_train
from tests.distributed import run_ranks
from tests.test_train import BASE, _straight_and_resumed, assert_same_curve, metrics

train = importlib.import_module("train")
data_dir = (
    test_train.data_dir
)  # The fixture: a small char-level corpus, made once here.
TOKENS_PER_STEP = 8 * 32  # BASE's batch: 8 sequences of 32 tokens


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory):
    """One process, the batch of 8 as one microbatch: its folder (metrics, model.pt)."""
    out = tmp_path_factory.mktemp("one-process")
    argv = ["--data-dir", data_dir, "--out-dir", str(out), "--micro-batch-size", "8"]
    train.main(BASE + argv)
    return out


def fake_clock():
    """A perf_counter that advances exactly 1 s a call: run_log times a step with one
    call, so a logged step of 8 x 32 tokens reads 256 tokens/s on any layout."""
    now = [0.0]

    def perf_counter():
        now[0] += 1.0
        return now[0]

    return types.SimpleNamespace(perf_counter=perf_counter)


def _layouts(rank, world, data_dir, tmp, configs, resume_extra):
    """Each config's train.main under the fake clock (rank 0 returns its train and val
    rows and the grid's group sizes), then, if given, 3 + 3 resumed steps against 6."""
    real = run_log.time
    run_log.time = fake_clock()
    out = []
    try:
        for name, extra in configs:
            out_dir = f"{tmp}/{name}"
            argv = BASE + ["--data-dir", data_dir, "--out-dir", out_dir] + extra
            train.main(argv)
            cfg, _ = train.parse_args(argv)
            grid = train.build_grid(cfg, rank, world)
            sizes = [dist.get_world_size(grid.dp_cp_group), grid.dp_cp, grid.cp]
            dist.barrier()
            rows = (metrics(out_dir), metrics(out_dir, "val")) if rank == 0 else None
            out.append((rows, sizes))
    finally:
        run_log.time = real
    resumed = None
    if resume_extra is not None:
        resumed = _straight_and_resumed(
            rank, world, data_dir, f"{tmp}/resume", resume_extra
        )
    return out, resumed


def check_layout(name, got, val, one_process):
    """The curve and the validation loss of one process (assert_same_curve's tolerance:
    fp32, the loss summed in another order; a gradient averaged over DP only, or a loss
    divided by cp, is off by > 1e-2), tokens counted once: the step's 8 x 32, never
    multiplied or divided by cp, and so 256 tokens/s under the fake clock."""
    ref = metrics(one_process)
    assert_same_curve(got, ref, name)
    ref_val = metrics(one_process, "val")
    assert [r["step"] for r in val] == [r["step"] for r in ref_val] == [3], name
    # A mean of 8 x 32 losses in another order: rounding, ~1e-7 relative.
    torch.testing.assert_close(
        val[0]["val_loss"], ref_val[0]["val_loss"], rtol=1e-5, atol=0
    )
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref], name
    assert [r["tokens_per_s"] for r in got] == [float(TOKENS_PER_STEP)] * 4, name


def test_cp2_alone_trains_evaluates_resumes_and_exports_as_one_process(
    data_dir, tmp_path, one_process
):
    """cp 2 with 1 and 4 microbatches, with ZeRO-1 and ZeRO-3 sharding over the 2 CP
    ranks (dp 1: the DP x CP group is the CP ranks), and with selective and full
    recomputation (the ring run again in the backward); the gradient-averaging group
    holds both CP ranks; model.pt equals one process's; 3 steps, --resume, 3 more: bit
    for bit."""
    cp2 = ["--cp", "2"]
    configs = [
        ("cp2", cp2 + ["--micro-batch-size", "8"]),
        ("cp2-accumulate", cp2 + ["--micro-batch-size", "2"]),
        ("cp2-zero1", cp2 + ["--micro-batch-size", "4", "--zero", "1"]),
        ("cp2-zero3", cp2 + ["--micro-batch-size", "4", "--zero", "3"]),
        (
            "cp2-selective",
            cp2 + ["--micro-batch-size", "4", "--recompute", "selective"],
        ),
        ("cp2-full", cp2 + ["--micro-batch-size", "4", "--recompute", "full"]),
    ]
    resume = cp2 + ["--micro-batch-size", "4"]
    out, resumed = run_ranks(
        _layouts, 2, data_dir, str(tmp_path), configs, resume, timeout=300
    )[0]
    for (name, _), ((got, val), sizes) in zip(configs, out):
        check_layout(name, got, val, one_process)
        assert sizes == [2, 2, 2], f"{name}: gradients averaged over DP x CP = 2 ranks"
    ref = torch.load(one_process / "model.pt", weights_only=True)
    for name in ("cp2", "cp2-zero3"):
        got = torch.load(tmp_path / name / "model.pt", weights_only=True)
        assert got["model"].keys() == ref["model"].keys()
        # AdamW divides each element's step by its own gradient's size: a rare token's
        # row has gradients near 1e-8, whose rounding (the loss summed in another order)
        # moves its lr·m/√v step by up to 1% of lr (measured 3e-5 once in 10,240); a
        # missed or doubled update is off by lr = 3e-3.
        for key, value in ref["model"].items():
            message = functools.partial(f"{name}, {key}: {{}}".format)
            torch.testing.assert_close(
                got["model"][key], value, rtol=1e-4, atol=1e-4, msg=message
            )
    straight, split = resumed
    assert [r["step"] for r in split] == list(range(6))
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in split] == [r["grad_norm"] for r in straight]


def test_cp2_with_dp_tp_pp_on_4_ranks_equals_one_process(
    data_dir, tmp_path, one_process
):
    """dp 2 x cp 2 (gradients over all 4 ranks; ZeRO-2 sharding over them), cp 2 x tp 2
    with sequence parallelism (T/cp = 16 tokens a rank, 8 a TP rank), cp 2 x pp 2 under
    1F1B (the pipeline's activations are (b, T/cp, C))."""
    configs = [
        ("dp2-cp2", ["--dp", "2", "--cp", "2", "--micro-batch-size", "2"]),
        (
            "dp2-cp2-zero2",
            ["--dp", "2", "--cp", "2", "--micro-batch-size", "4", "--zero", "2"],
        ),
        (
            "cp2-tp2-sp",
            [
                "--cp",
                "2",
                "--tp",
                "2",
                "--micro-batch-size",
                "4",
                "--sequence-parallel",
            ],
        ),
        ("cp2-pp2", ["--cp", "2", "--pp", "2", "--micro-batch-size", "2"]),
    ]
    out, _ = run_ranks(
        _layouts, 4, data_dir, str(tmp_path), configs, None, timeout=400
    )[0]
    expected = {"dp2-cp2": 4, "dp2-cp2-zero2": 4, "cp2-tp2-sp": 2, "cp2-pp2": 2}
    for (name, _), ((got, val), sizes) in zip(configs, out):
        check_layout(name, got, val, one_process)
        n = expected[name]
        assert sizes == [n, n, 2], (
            f"{name}: gradients averaged over DP x CP = {n} ranks"
        )


def test_cp_flags_fail_in_one_line(data_dir, capsys):
    """The world names all five numbers; a --block-size that 2·cp chunks do not divide;
    attention dropout the ring lacks; --cp explained in --help."""
    argv = BASE + ["--data-dir", data_dir]
    cases = [
        (
            ["--cp", "2", "--dp", "2"],
            2,
            "world_size=2 but --dp 2 x --cp 2 x --tp 1 x --pp 1 = 4",
        ),
        (["--cp", "3"], 3, "--block-size 32: --cp 3 cuts a sequence in 6 chunks"),
        (["--cp", "2", "--dropout", "0.1"], 2, "--dropout 0.1 with --cp 2"),
        (
            ["--cp", "2", "--tp", "2", "--sequence-parallel", "--block-size", "30"],
            4,
            "--block-size 30: --cp 2 cuts a sequence in 4 chunks",
        ),
        (
            ["--cp", "2", "--tp", "4", "--sequence-parallel", "--block-size", "12"]
            + ["--model", "small"],  # 4 heads for 4 TP ranks
            8,
            "--sequence-parallel shards the 6 tokens of a sequence over --tp 4 ranks",
        ),
    ]
    for extra, world, message in cases:
        cfg, _ = train.parse_args(argv + extra)
        with pytest.raises(train.ConfigError, match="^" + re.escape(message)):
            train.validate(cfg, world)
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--cp CP context-parallel ranks" in help_text
    assert "for long --block-size" in help_text
