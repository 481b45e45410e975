"""train.py's --config and --plan (issue 33): a recipe runs with the command line over
it, its resolved settings come back as OUT/config.toml (and in the checkpoint's meta),
a bad recipe is one line before anything starts, --plan prints 09's plan of the run
without a process group, and metrics.jsonl logs 09's prediction beside the measured.
"""

import importlib
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import train
from support.train import run_log
from support.train.command_line import parse_args

ROOT = Path(__file__).resolve().parent.parent
plan_lib = importlib.import_module("09_plan")
data_lib = importlib.import_module("01_data")


def run_train(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small char-level corpus: 12 documents of pseudo-code."""
    root = tmp_path_factory.mktemp("plan-data")
    src = root / "src"
    src.mkdir()
    for d in range(12):
        lines = [f"def f{d}_{i}(x):\n    return x * {i} + {d}\n" for i in range(60)]
        (src / f"doc{d}.py").write_text("".join(lines))
    data_lib.prepare(str(src), "char", root / "data", block_size=32)
    return root / "data"


def test_a_recipe_runs_under_the_command_line_and_writes_its_settings(tmp_path, data):
    """cpu-demo.toml under a recipe of this test (base =) and flags: the file's values
    reach the run, the flags win, config.toml reloads to the same settings, and every
    logged row holds 09's prediction of this very run beside the measured numbers."""
    demo = ROOT / "recipes" / "cpu-demo.toml"
    child = tmp_path / "child.toml"
    text = f'base = "{demo}"\n[model]\nmodel = "tiny"\n[optimizer]\nlr = 0.002\n'
    child.write_text(text + "max_steps = 50\n[run]\nseed = 7\n")
    out = tmp_path / "out"
    flags = ["--max-steps", "2", "--data-dir", str(data), "--block-size", "32"]
    flags += ["--eval-interval", "0", "--eval-steps", "1", "--ckpt-interval", "0"]
    flags += ["--sample-tokens", "0"]
    flags += ["--out-dir", str(out), "--log-interval", "1", "--seed", "9"]
    done = run_train("--config", str(child), *flags)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "predicted by 09_plan.py (cpu): peak memory" in done.stdout

    # config.toml: the base's, the file's over it, the flags' over both.
    cfg, _ = parse_args(["--config", str(out / "config.toml")])
    assert (cfg.model, cfg.lr, cfg.batch_size, cfg.micro_batch_size) == (
        "tiny",  # the child's
        0.002,  # the child's, over the default 3e-3
        32,  # cpu-demo's
        8,
    )
    assert (cfg.max_steps, cfg.seed, cfg.block_size) == (2, 9, 32)  # the flags'
    same, _ = parse_args(["--config", str(child), *flags])
    assert cfg == same  # the round trip: every setting as the run had it
    meta = next((out / "checkpoints").glob("step_*/meta.json"))
    assert json.loads(meta.read_text())["config"] == asdict(cfg)

    # metrics.jsonl: 09's plan of this run, made here from 09 with the layout by hand.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    rows = [r for r in rows if r["kind"] == "train"]
    n_vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    model = plan_lib.model_config("tiny", vocab_size=n_vocab, block_size=32)
    layout = plan_lib.Layout(micro_batch=8)
    want = plan_lib.plan(model, layout, 32, "cpu", 1, 1, 32, "fp32")
    assert len(rows) == 2
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["peak_mem_gb"] > 0  # measured
        # JSON keeps a float's shortest repr: equal to the last bit.
        assert row["predicted_tokens_per_s"] == want.tokens_per_s
        assert row["predicted_peak_mem_gb"] == want.memory["total"] / 1e9


def test_a_planner_that_fails_is_one_line_and_the_run_trains(
    tmp_path, data, capsys, monkeypatch
):
    """09's plan is advisory in a run: a plan_run that raises something other than 09's
    ValueError (here a KeyError) is one printed line, and the run trains without a plan.
    Before, only ValueError was caught: the KeyError ended the run (on rank 0 alone, with
    more ranks: the others waited in a collective until the timeout)."""

    def broken(*args):
        raise KeyError("n_head")

    monkeypatch.setattr(plan_lib, "plan_run", broken)
    flags = ["--model", "tiny", "--block-size", "32", "--batch-size", "8"]
    flags += ["--max-steps", "2", "--eval-interval", "0", "--eval-steps", "1"]
    flags += ["--ckpt-interval", "0", "--sample-tokens", "0", "--log-interval", "1"]
    train.main(flags + ["--data-dir", str(data), "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if "09_plan.py" in line]
    want = "predicted by 09_plan.py: nothing (failed: KeyError: 'n_head')"
    assert said == [want], out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [0, 1]
    assert not any("predicted_tokens_per_s" in r for r in rows)


BAD = {
    "malformed": ("[optimizer\nlr = 0.1\n", "malformed TOML"),
    "unknown key": ("[optimizer]\nlearning_rate = 0.1\n", "learning_rate: unknown"),
    "wrong type": ('[batch]\nbatch_size = "32"\n', "expected int, got str"),
    "out of range": ("[optimizer]\nlr = -1.0\n", "--lr must be > 0, got -1.0"),
}


def test_a_bad_recipe_is_one_line_and_nothing_starts(tmp_path, capsys, monkeypatch):
    """train.main as `python train.py` runs it: a SystemExit(2) with one line on stderr
    (any other exception, a traceback, fails pytest.raises), before a process group
    (patched to fail here) or the out dir exists."""
    bad = tmp_path / "bad.toml"

    def no_group(*args):
        raise AssertionError("a process group was started")

    monkeypatch.setattr(train.distributed, "init_distributed", no_group)
    for case, (text, expected) in BAD.items():
        bad.write_text(text)
        with pytest.raises(SystemExit) as exit:
            train.main(["--config", str(bad), "--out-dir", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert exit.value.code == 2, case
        assert err.startswith("train.py: error: ") and err.count("\n") == 1, err
        assert "bad.toml" in err and expected in err, err
    assert not (tmp_path / "o").exists()


def test_plan_prints_09s_plan_of_the_run_and_starts_nothing(tmp_path, capsys):
    """--plan with dp x pp on H100s: the lines are 09's for the layout written out here
    by hand; no data is read or made, no process group or out dir appears. (tp 1: the
    vocabulary's padding is support/train/vocab's business, not --plan's.)"""
    args = ["--plan", "--plan-gpu", "h100", "--model", "gpt2", "--tokenizer", "gpt2"]
    args += ["--dp", "4", "--pp", "2", "--schedule", "gpipe", "--zero", "1"]
    args += ["--max-steps", "10"]
    args += [
        "--batch-size",
        "64",
        "--micro-batch-size",
        "4",
        "--recompute",
        "selective",
    ]
    args += ["--data-dir", str(tmp_path / "no-data"), "--out-dir", str(tmp_path / "o")]
    train.main(args)
    printed = capsys.readouterr().out
    sizes = dict(dp=4, tp=1, pp=2, cp=1, zero=1, micro_batch=4, virtual_stages=1)
    layout = plan_lib.Layout(**sizes, recompute="selective", schedule="gpipe")
    model = plan_lib.model_config("gpt2", vocab_size=50257)  # padded to 50,304
    want = plan_lib.plan(model, layout, 64, "h100", 8, 8, 1024, "bf16", compiled=False)
    for line in plan_lib.plan_report.describe(want):
        assert line in printed, printed
    assert "gpt2 on 8 x h100, batch 64 x 1024, bf16" in printed
    assert "10 steps, 655,360 tokens" in printed  # 10 x 64 x 1,024
    assert not dist.is_initialized()
    assert not (tmp_path / "no-data").exists() and not (tmp_path / "o").exists()


def test_plan_of_a_recipe_plans_for_its_gpu_in_seconds():
    """The 8-GPU recipe on this CPU: its [plan] GPU, no torchrun, exit 0, in seconds
    (~7 s of CPU: importing torch and the lessons; the timeout allows the 2-core machine
    under a loaded suite)."""
    done = run_train("--config", "recipes/gpt2-124m-8gpu.toml", "--plan", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpt2 on 8 x h100, batch 512 x 1024" in done.stdout
    assert "dp 8 tp 1 pp 1 zero 0 mb 16 none" in done.stdout
    assert "fits in" in done.stdout and "step" not in done.stdout.replace("steps", "")


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),  # its own peaks, HBM and links
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),  # half the memory
        ("AMD Instinct MI300X VF", "mi300x"),  # a VM's virtual function: the card
        ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),  # another card: unknown
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe"),  # not in the table
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),  # peaks only
    ],
)
def test_the_gpu_found_is_a_row_of_09s_table_or_named_as_unknown(
    monkeypatch, name, key
):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert run_log.gpu_key(torch.device("cuda")) == key
    assert run_log.gpu_key(torch.device("cpu")) == "cpu"
