"""train.py: every parallel layout trains like one process; checkpoints resume bit for bit,
survive SIGTERM and crashes; export gives one model; bad flags fail fast."""

import dataclasses
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from support.train import checkpoint
from support.train import export as export_lib
from support.train.command_line import parse_args
from tests.distributed import run_ranks

train = importlib.import_module("train")
data = importlib.import_module("01_data")
ROOT = Path(__file__).resolve().parents[1]

# A 4-layer tiny GPT (pp=2 x v=2 needs 4 blocks), 8 sequences of 32 per step, fp32.
BASE = ["--model", "tiny", "--n-layer", "4", "--batch-size", "8", "--max-steps", "4",
        "--warmup-steps", "2", "--log-interval", "1", "--eval-interval", "0", "--eval-steps", "1",
        "--ckpt-interval", "0", "--sample-tokens", "0", "--dtype", "fp32"]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small char-level corpus: 30 documents of pseudo-code, ~150 KB."""
    root = tmp_path_factory.mktemp("train-data")
    src = root / "src"
    src.mkdir()
    for d in range(30):
        lines = [f"def f{d}_{i}(x):\n    return x * {i} + {d}\n" for i in range(120)]
        (src / f"doc{d}.py").write_text("".join(lines))
    data.prepare(str(src), "char", root / "data", block_size=32)
    return str(root / "data")


def metrics(out_dir, kind="train") -> list[dict]:
    rows = [json.loads(r) for r in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def run_main(argv):
    """train.main in this process (a world of one)."""
    train.main(argv)


def _train_configs(rank, world, data_dir, tmp, configs):
    """Run train.main once per config inside one spawned world; rank 0 returns the metrics."""
    out = []
    for name, extra in configs:
        out_dir = f"{tmp}/{name}"
        train.main(BASE + ["--data-dir", data_dir, "--out-dir", out_dir] + extra)
        dist.barrier()
        out.append(metrics(out_dir) if rank == 0 else None)
    return out


def assert_same_curve(got, ref, what):
    """fp32 with a different reduction order (TP splits matmuls, DP and accumulation sum in
    other orders) differs from one process by rounding, ~1e-6 relative per op; four AdamW
    steps keep that far below 1e-4 on a loss of ~5 and a grad norm of ~2. A real bug (a missed
    all-reduce, a wrong 1/m) is off by > 1e-2."""
    assert [r["step"] for r in got] == [r["step"] for r in ref], what
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]),
            rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{what}, {key}: {m}")  # fmt: skip


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One process, the whole batch of 8 as one microbatch."""
    out = tmp_path_factory.mktemp("ref")
    run_main(BASE + ["--data-dir", data_dir, "--out-dir", str(out), "--micro-batch-size", "8"])
    return metrics(out)


def test_accumulation_x4_equals_one_batch(data_dir, tmp_path, reference):
    run_main(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--micro-batch-size", "2"])
    assert_same_curve(metrics(tmp_path), reference, "1 process, 4 microbatches of 2")


def test_the_chunked_loss_trains_evaluates_and_samples_as_the_plain_one(data_dir, tmp_path,
                                                                         monkeypatch, capsys):  # fmt: skip
    """--loss chunked (06b's lm_head + loss by chunks of tokens) over 4 accumulated microbatches:
    the train and validation curves of --loss plain (fp32; the tolerance: assert_same_curve's,
    the chunked sum runs in another order), the chunked loss really called, and model.pt rebuilt
    plain: its logits real, its sample printed."""
    called = []
    chunked = train.recompute_lib.chunked_cross_entropy

    def spy(*args, **kwargs):
        called.append(1)
        return chunked(*args, **kwargs)

    monkeypatch.setattr(train.recompute_lib, "chunked_cross_entropy", spy)
    argv = BASE + ["--data-dir", data_dir, "--micro-batch-size", "2", "--eval-interval", "2"]
    run_main(argv + ["--out-dir", str(tmp_path / "plain")])
    assert not called, "--loss plain: 02's loss"
    run_main(argv + ["--out-dir", str(tmp_path / "chunked"), "--loss", "chunked",
                     "--sample-tokens", "8"])  # fmt: skip
    assert len(called) == 4 * 4 + 3 * 4, "4 steps, 3 evaluations (0, 2, end): 4 microbatches"
    assert "--- sample (8 tokens) ---" in capsys.readouterr().out
    for kind in ("train", "val"):
        got = metrics(tmp_path / "chunked", kind)
        ref = metrics(tmp_path / "plain", kind)
        if kind == "val":  # assert_same_curve's keys, from the validation rows
            got = [{"step": r["step"], "loss": r["val_loss"], "grad_norm": 0} for r in got]
            ref = [{"step": r["step"], "loss": r["val_loss"], "grad_norm": 0} for r in ref]
        assert_same_curve(got, ref, f"--loss chunked, {kind}")
    model, _ = train.load_exported(tmp_path / "chunked" / "model.pt")
    logits, _ = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, model.config.padded_vocab_size)


def test_two_rank_layouts_equal_one_process(data_dir, tmp_path, reference):
    """dp=2 (+ZeRO 1, 2, 3), tp=2 (+sequence parallelism), pp=2 under every schedule: same curve.
    fp16 (06's loss scaler) with the pipeline and with ZeRO-2, whose gradients the scaler finds
    in the optimizer's shards, not in p.grad. The chunked loss (06b) in the pipeline's last stage
    and under ZeRO-3. model.pt alike at tp 2 and 1, though tp 2 trains 64·2 vocabulary rows."""
    dp2, pp2 = ["--dp", "2", "--micro-batch-size", "2"], ["--pp", "2", "--micro-batch-size", "2"]
    configs = [
        ("dp2", dp2),
        *[(f"dp2-zero{z}", dp2 + ["--zero", z]) for z in "123"],
        ("tp2", ["--tp", "2", "--micro-batch-size", "4"]),
        ("tp2-sp", ["--tp", "2", "--micro-batch-size", "4", "--sequence-parallel"]),
        ("pp2-gpipe", pp2 + ["--schedule", "gpipe"]),
        ("pp2-1f1b", pp2 + ["--schedule", "1f1b"]),
        ("pp2-interleaved", pp2 + ["--schedule", "interleaved", "--virtual-stages", "2"]),
        ("pp2-fp16", pp2 + ["--dtype", "fp16"]),
        ("dp2-zero2-fp16", dp2 + ["--zero", "2", "--dtype", "fp16"]),
        ("pp2-chunked", pp2 + ["--loss", "chunked"]),
        ("dp2-zero3-chunked", dp2 + ["--zero", "3", "--loss", "chunked"]),
        *COMPRESSED,
    ]
    results = run_ranks(_train_configs, 2, data_dir, str(tmp_path), configs, timeout=300)[0]
    for (name, _), got in zip(configs, results):
        if name in dict(COMPRESSED):
            check_compressed(name, got, reference, results[0], data_dir)
        elif name.endswith("fp16"):  # loss scaling: 16-bit rounding, as in the 16-bit test below
            for key in ("loss", "grad_norm"):  # a norm of scaled gradients is x 65536
                torch.testing.assert_close(torch.tensor([r[key] for r in got]),
                                           torch.tensor([r[key] for r in reference]), rtol=2e-3,
                                           atol=0, msg=lambda m, k=key, n=name: f"{n}, {k}: {m}")  # fmt: skip
        else:
            assert_same_curve(got, reference, name)
        if name.startswith("dp2") and name not in dict(COMPRESSED):  # 4Ψ (ZeRO: + its padding)
            pad = [r["comm_bytes"] - results[0][0]["comm_bytes"] for r in got]
            assert all(0 <= b < 4 * 2 * 16 for b in pad), f"{name}: comm_bytes - 4Ψ = {pad}"
    assert "comm_bytes" not in reference[0], "one process sends nothing"
    tp1 = torch.load(tmp_path / "dp2" / "model.pt", weights_only=True)
    tp2 = torch.load(tmp_path / "tp2" / "model.pt", weights_only=True)
    assert tp2["model_config"] == tp1["model_config"], "64 rows, not tp 2's 128"
    assert tp2["model"].keys() == tp1["model"].keys()
    for key, value in tp1["model"].items():  # 4 AdamW steps on curves equal to 1e-4: the
        # weights moved by lr 3e-3 a step differ by rounding, measured < 1e-6
        torch.testing.assert_close(tp2["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)


# PowerSGD: 1 exact step, then sketched; "full": rank 32 = min(m, n) of every matrix of the tiny GPT
COMPRESSED = [
    ("dp2-fp16-comm", ["--dp", "2", "--micro-batch-size", "2", "--grad-compression", "fp16"]),
    ("dp2-powersgd-r1", ["--dp", "2", "--micro-batch-size", "2", "--grad-compression", "powersgd",
                         "--powersgd-rank", "1", "--powersgd-warmup-steps", "1"]),
]  # fmt: skip
FULL_RANK = ["--grad-compression", "powersgd", "--powersgd-rank", "32", "--powersgd-warmup-steps",
             "0"]  # fmt: skip


def check_compressed(name, got, reference, uncompressed, data_dir):
    """comm_bytes, the bytes each rank all-reduced per step: fp16 half of fp32's (4Ψ, measured
    by the dp2 run); PowerSGD r=1 4Ψ in its exact step, then 4·(Σ(m+n) + Σ vectors). The
    loss: fp16 within 16-bit rounding of one process; PowerSGD r=1 a sketch, near it."""
    cfg, _ = parse_args(BASE + ["--data-dir", data_dir])
    gpt = train.model_lib.GPT(train.validate(cfg, 1))
    psi = sum(p.numel() for p in gpt.parameters())
    assert [r["comm_bytes"] for r in uncompressed] == [4 * psi] * 4, "dp2: fp32, every parameter"
    sketch = sum(len(p) + p[0].numel() if p.dim() == 2 else p.numel() for p in gpt.parameters())
    expected = [2 * psi] * 4 if "fp16" in name else [4 * psi] + [4 * sketch] * 3
    assert [r["comm_bytes"] for r in got] == expected, name
    # measured (relative): fp16 1.3e-4 (grad norm), within the 16-bit test's 2e-3; r=1's loss
    # 4.9e-4, where the sketch not applied moves it by 2.4e-2 and a Q not / N by 5.4e-3 (its grad
    # norm is the sketch's, 7% off: not compared)
    rtol = 2e-3
    for key in ("loss", "grad_norm") if "fp16" in name else ("loss",):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]),
                                   torch.tensor([r[key] for r in reference]), rtol=rtol, atol=0,
                                   msg=lambda m, k=key: f"{name}, {k}: {m}")  # fmt: skip


def test_zero_composes_with_tp_and_pp_on_4_ranks(data_dir, tmp_path, reference):
    """ZeRO shards inside the DP group: stage 3 with TP (+SP: the norm counts each piece of a
    replicated LayerNorm once), stage 2 with 1F1B (the tied embedding's shard gradients summed
    over the first and last stage), stage 1 with two interleaved chunks (one optimizer). And
    tp 2 x pp 2 with sequence parallelism: the pipeline sends (b, T/tp, C) token shards."""
    dp2 = ["--dp", "2", "--micro-batch-size", "2"]
    configs = [
        ("dp2-tp2-zero3-sp", dp2 + ["--tp", "2", "--zero", "3", "--sequence-parallel"]),
        ("dp2-pp2-zero2", dp2 + ["--pp", "2", "--zero", "2", "--micro-batch-size", "1"]),
        ("dp2-pp2-zero1-interleaved", dp2 + ["--pp", "2", "--zero", "1", "--micro-batch-size",
                                             "1", "--schedule", "interleaved", "--virtual-stages", "2"]),
        ("dp2-tp2-powersgd-full", dp2 + ["--tp", "2"] + FULL_RANK),  # each TP shard sketched
        ("dp2-pp2-powersgd-full", dp2 + ["--pp", "2", "--micro-batch-size", "1"] + FULL_RANK),
        ("tp2-pp2-sp", ["--tp", "2", "--pp", "2", "--micro-batch-size", "2", "--sequence-parallel"]),
    ]  # fmt: skip
    results = run_ranks(_train_configs, 4, data_dir, str(tmp_path), configs, timeout=300)[0]
    for (name, _), got in zip(configs, results):
        assert_same_curve(got, reference, name)


def test_3d_parallel_on_8_ranks_equals_one_process(data_dir, tmp_path, reference):
    dp2_tp2_pp2 = ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batch-size", "2"]
    configs = [("dp2-tp2-pp2", dp2_tp2_pp2), ("dp2-tp2-pp2-zero2", dp2_tp2_pp2 + ["--zero", "2"])]
    results = run_ranks(_train_configs, 8, data_dir, str(tmp_path), configs, timeout=420)[0]
    for (name, _), got in zip(configs, results):
        assert_same_curve(got, reference, name)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_training_follows_fp32_and_only_fp16_uses_a_scaler(data_dir, tmp_path, reference,
                                                                   dtype):  # fmt: skip
    """Autocast keeps weights, the loss and its softmax in fp32 and rounds matmul inputs to 16
    bits (relative error 2^-8 for bf16, 2^-11 for fp16); over 4 steps the loss moves by ~1e-5
    relative here and the grad norm by up to 7e-4 (bf16), so rtol 2e-3 leaves room and still
    catches a missing 1/m, a skipped step or a norm taken before unscaling (x 65536)."""
    run_main(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--micro-batch-size",
                     "4", "--dtype", dtype])  # fmt: skip
    got = metrics(tmp_path)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]),
                                   torch.tensor([r[key] for r in reference]), rtol=2e-3, atol=0,
                                   msg=lambda m, key=key: f"{dtype}, {key}: {m}")  # fmt: skip
    shard = torch.load(checkpoint.complete_checkpoints(tmp_path)[0] / checkpoint.shard_name(0),
                       weights_only=True)  # fmt: skip
    if dtype == "fp16":
        assert shard["scaler"]["scale"] == 2.0**16  # no overflow in 4 steps: never backed off
    else:
        assert shard["scaler"] == {}  # bf16 has fp32's range: no scaler at all


def _recompute_runs(rank, world, data_dir, tmp, configs):
    """_train_configs, and rank 0 also returns each run's exported weights (model.pt)."""
    curves = _train_configs(rank, world, data_dir, tmp, configs)
    if rank != 0:
        return None
    weights = [
        torch.load(f"{tmp}/{name}/model.pt", weights_only=True)["model"] for name, _ in configs
    ]
    return list(zip(curves, weights))


def test_recomputation_changes_no_bit_on_any_layout(data_dir, tmp_path):
    """--recompute selective and full against none, dropout 0.1, on 2 ranks: tp 2 with sequence
    parallelism (the replay must rewind 04's per-rank dropout stream too, and redo the forward's
    all-gathers and reduce-scatters), pp 2 under 1F1B and interleaved (blocks recomputed while
    other microbatches are in flight) and dp 2 with ZeRO-3 (the weights re-gathered for the
    backward). Losses and gradient norms with ==, and the weights after 4 AdamW steps with
    torch.equal: any gradient off by one rounding would move them. Recomputation redoes the
    same ops on the same numbers."""
    pp2 = ["--pp", "2", "--micro-batch-size", "2"]
    layouts = {"tp2-sp": ["--tp", "2", "--micro-batch-size", "4", "--sequence-parallel"],
               "pp2-1f1b": pp2,
               "pp2-interleaved": pp2 + ["--schedule", "interleaved", "--virtual-stages", "2"],
               "dp2-zero3": ["--dp", "2", "--micro-batch-size", "2", "--zero", "3"]}  # fmt: skip
    configs = [(f"{name}-{mode}", flags + ["--dropout", "0.1", "--recompute", mode])
               for name, flags in layouts.items() for mode in ("none", "selective", "full")]  # fmt: skip
    runs = run_ranks(_recompute_runs, 2, data_dir, str(tmp_path), configs, timeout=300)[0]
    results = dict(zip((n for n, _ in configs), runs))
    for name in layouts:
        none_curve, none_weights = results[f"{name}-none"]
        for mode in ("selective", "full"):
            curve, weights = results[f"{name}-{mode}"]
            for key in ("loss", "grad_norm"):
                assert [r[key] for r in curve] == [r[key] for r in none_curve], (name, mode, key)
            assert weights.keys() == none_weights.keys()
            for k in weights:
                assert torch.equal(weights[k], none_weights[k]), (name, mode, k)


# ---------------------------------------------------------------------------------------------
# Exact resume
# ---------------------------------------------------------------------------------------------
def _straight_and_resumed(rank, world, data_dir, tmp, extra):
    """6 steps straight; then 3 steps, stop, --resume, 3 more. Rank 0 returns both curves."""
    common = BASE + ["--data-dir", data_dir, "--max-steps", "6"] + extra
    train.main(common + ["--out-dir", f"{tmp}/straight"])
    train.main(common + ["--out-dir", f"{tmp}/split", "--steps-this-run", "3"])
    train.main(common + ["--out-dir", f"{tmp}/split", "--resume"])
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        return metrics(f"{tmp}/straight"), metrics(f"{tmp}/split")
    return None


@pytest.mark.parametrize(
    "world, extra",
    [(1, ["--micro-batch-size", "4", "--dropout", "0.1", "--lr-schedule", "wsd",
          "--decay-fraction", "0.5"]),  # the resume at step 3 is inside WSD's decay (steps 2..5)
     (4, ["--dp", "2", "--tp", "2", "--micro-batch-size", "2", "--dropout", "0.1"]),
     (2, ["--dp", "2", "--zero", "3", "--micro-batch-size", "2", "--dropout", "0.1"]),
     (2, ["--dp", "2", "--micro-batch-size", "2", "--grad-compression", "powersgd",
          "--powersgd-rank", "2", "--powersgd-warmup-steps", "2"])],  # resumed with Q, residuals
    ids=["1-rank", "dp2-tp2", "dp2-zero3", "dp2-powersgd"],
)  # fmt: skip
def test_resume_is_bit_identical(data_dir, tmp_path, world, extra):
    """Dropout on, so the RNG states must be restored too. Losses and gradient norms are
    compared with == (the 1-rank case resumes inside WSD's decay)."""
    if world == 1:
        straight, split = _straight_and_resumed(0, 1, data_dir, str(tmp_path), extra)
    else:
        straight, split = run_ranks(_straight_and_resumed, world, data_dir, str(tmp_path), extra,
                                    timeout=240)[0]  # fmt: skip
    assert [r["step"] for r in split] == list(range(6))
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in split] == [r["grad_norm"] for r in straight]


# ---------------------------------------------------------------------------------------------
# Preemption, crashes, corruption
# ---------------------------------------------------------------------------------------------
def launch(argv, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)  # fmt: skip


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(data_dir, tmp_path):
    args = ["train.py", *BASE, "--data-dir", data_dir, "--out-dir", str(tmp_path),
            "--max-steps", "400"]  # fmt: skip
    proc = launch(args)
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").is_file() or len(metrics(tmp_path)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "preemption signal: saving at step" in output
    ckpts = checkpoint.complete_checkpoints(tmp_path)
    assert len(ckpts) == 1
    saved = json.loads((ckpts[0] / "meta.json").read_text())["step"]
    assert saved < 399, "SIGTERM should stop the run early"

    done = subprocess.run([sys.executable, *args, "--resume", "--max-steps", str(saved + 3)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from {ckpts[0]} (step {saved})" in done.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(saved + 3))


def test_sigterm_during_a_long_evaluation_is_honoured_within_seconds(data_dir, tmp_path):
    """A preempted job must save before torchrun's shutdown timeout, so a signal that arrives
    during evaluation ends it after the current batch. Here the step-0 evaluation has 10^6
    batches (a quarter of an hour): checked only at step boundaries, the signal would wait for
    all of them and the 60 s below run out."""
    args = ["train.py", *BASE, "--data-dir", data_dir, "--out-dir", str(tmp_path),
            "--eval-interval", "1", "--eval-steps", "1000000"]  # fmt: skip
    proc = launch(args)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").is_file() or not metrics(tmp_path):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        time.sleep(1)  # step 0 is logged: its evaluation is running
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert [c.name for c in checkpoint.complete_checkpoints(tmp_path)] == ["step_0000000"]
    assert metrics(tmp_path, "val") == []  # a half-done evaluation is not logged as a loss


CRASH_IN_SECOND_SAVE = """
import os, sys, torch
sys.argv = ["train.py"] + sys.argv[1:]
calls, real_save = [0], torch.save
def dying_save(obj, f, *a, **k):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint: write half a file, then die like a kill -9
        real_save(obj, f, *a, **k)
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
        os._exit(9)
    return real_save(obj, f, *a, **k)
torch.save = dying_save
import train
train.main()
"""


def test_a_crash_during_a_checkpoint_write_keeps_the_previous_one(data_dir, tmp_path):
    args = [*BASE, "--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "8",
            "--ckpt-interval", "3"]  # fmt: skip
    crashed = subprocess.run([sys.executable, "-c", CRASH_IN_SECOND_SAVE, *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert crashed.returncode == 9, crashed.stdout + crashed.stderr
    assert [d.name for d in checkpoint.complete_checkpoints(tmp_path)] == ["step_0000002"]
    assert (tmp_path / "checkpoints" / "step_0000005.partial").is_dir()  # the half-written one
    resumed = subprocess.run([sys.executable, "train.py", *args, "--resume"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "(step 2)" in resumed.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(8))


def test_a_corrupt_checkpoint_is_named_and_the_previous_one_used(data_dir, tmp_path, capsys):
    args = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--ckpt-interval", "2"]
    run_main(args)  # checkpoints at steps 1 and 3
    newest = checkpoint.complete_checkpoints(tmp_path)[0] / checkpoint.shard_name(0)
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    run_main(args + ["--resume", "--max-steps", "5"])
    out = capsys.readouterr().out
    assert f"checkpoint file {newest} is unreadable" in out
    assert "(step 1)" in out


def test_a_file_whose_piece_disagrees_with_meta_json_falls_back(data_dir, tmp_path, capsys):
    """A file that reads but holds a piece of another size than meta.json's row (a stale
    file, another job's write) is named before the restore and the previous checkpoint used;
    inside the restore it would stop the run (an out-of-bounds copy)."""
    args = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--ckpt-interval", "2"]
    run_main(args)  # checkpoints at steps 1 and 3
    newest = checkpoint.complete_checkpoints(tmp_path)[0] / checkpoint.shard_name(0)
    shard = torch.load(newest, weights_only=True)
    shard["pieces"][0]["tensor"] = shard["pieces"][0]["tensor"].reshape(-1)[:-1]  # cut short
    torch.save(shard, newest)
    run_main(args + ["--resume", "--max-steps", "5"])
    out = capsys.readouterr().out
    assert f"checkpoint file {newest} is unreadable" in out and "is not meta.json's" in out
    assert "(step 1)" in out


def test_resume_survives_ordinary_damage(data_dir, tmp_path, capsys):
    """What a kill or a full disk leaves behind, all at once: an empty meta.json in the newest
    checkpoint (--export and --resume fall back to the previous one instead of a JSON error), a
    torn last line in metrics.jsonl (skipped, not a JSONDecodeError), and a stale
    step_N.partial/ of a save that never finished (removed at start). A torn line can also end
    in "}": after a crash, a row's unflushed bytes read back as NULs, its newline among them, so
    the next row, whole, lands on the same line (json.loads raised, on rank 0 only: a hang)."""
    args = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--ckpt-interval", "2"]
    run_main(args)  # checkpoints at steps 1 and 3
    (checkpoint.complete_checkpoints(tmp_path)[0] / "meta.json").write_text("")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 2, "lo' + "\0" * 8)  # the rest never reached the disk
        f.write('{"kind": "train", "step": 3, "loss": 4.0}\n')  # the next row, on the same line
        f.write('{"kind": "train", "step": 4, "lo')  # half a row: killed mid-write
    stale = tmp_path / "checkpoints" / "step_0000099.partial"
    stale.mkdir()
    assert train.load_exported(train.export(tmp_path))[1]["step"] == 1
    run_main(args + ["--resume", "--max-steps", "6"])
    out = capsys.readouterr().out
    assert "meta.json is unreadable" in out and "(step 1)" in out
    assert out.count("skipping a torn line") == 2
    assert [r["step"] for r in metrics(tmp_path)] == list(range(6))
    assert not stale.exists()


def test_resume_loads_shards_to_the_cpu_whatever_the_run_device(data_dir, tmp_path):
    """--resume died on every CUDA run: torch.load(map_location=run.device) moved the saved RNG
    states to the GPU, and torch.set_rng_state / torch.cuda.set_rng_state take CPU byte tensors
    only. With no GPU here, `meta` stands in for "a run device other than the shard's": the
    model stays on the CPU but run.device is meta. Loading to run.device (the bug) gives
    data-less meta tensors and the restore fails; loading to the CPU restores the weights,
    AdamW's state (on its parameters' device) and the RNG exactly."""
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "2"]
    run_main(argv)
    cfg, _ = parse_args(argv + ["--resume"])
    run = train.build_run(cfg, train.validate(cfg, 1), train.grid_lib.Grid(), torch.device("cpu"))
    run = dataclasses.replace(run, device=torch.device("meta"))
    torch.manual_seed(0)  # somewhere else: the restore must bring back the saved state
    assert train.checkpoint.load_checkpoint(run) == 2
    ckpt = checkpoint.complete_checkpoints(tmp_path)[0]
    shard = torch.load(ckpt / checkpoint.shard_name(0), weights_only=True)
    params = run.modules()[0].state_dict()
    for name, saved in export_lib.read_model(ckpt)[1].items():  # assembled from its pieces
        assert torch.equal(params[name], saved), name
    states = [t for s in run.optimizer.state.values() for t in s.values()]
    assert states and all(t.device.type == "cpu" for t in states)
    assert torch.equal(torch.get_rng_state(), shard["rng"]["torch"])


def _one_rank_of_two_damaged(rank, world, data_dir, tmp):
    """1. SIGTERM to rank 1 only, after step 3 of 6, at dp 2 and at pp 2, the ranks voting
    every 2 steps (after steps 0, 2, 4): returns the checkpoints each rank sees per layout.
    2. Rank 1's shard of the newest checkpoint truncated: returns the step each rank resumes at.
    3. Rank 1's disk full while it writes its shard of step 3: what each rank raised, how fast.
    4. A ZeRO-1 checkpoint that fits rank 0 but not rank 1: what each rank's resume raised."""
    common = BASE + ["--data-dir", data_dir, "--micro-batch-size", "2"]
    real_step = train.train_step

    def step_then_signal(run, step):
        stats = real_step(run, step)
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # this process only, as a node's kill would
        return stats

    train.train_step = step_then_signal
    checkpoint.VOTE_SECONDS = 1e9  # Every 2 steps, however slow a step on a loaded CPU.
    saved = {}
    for name in ("dp", "pp"):
        out_dir = f"{tmp}/sigterm-{name}"
        train.main(common + [f"--{name}", "2", "--out-dir", out_dir, "--max-steps", "6",
                             "--vote-interval", "2"])  # fmt: skip
        ckpts = checkpoint.complete_checkpoints(out_dir)
        saved[name] = [(c.name, sorted(p.name for p in c.glob("rank_*.pt"))) for c in ckpts]
    train.train_step = real_step
    checkpoint.VOTE_SECONDS = 10.0

    argv = common + ["--dp", "2", "--out-dir", f"{tmp}/corrupt", "--ckpt-interval", "2"]
    train.main(argv)  # checkpoints at steps 1 and 3
    dist.barrier()
    if rank == 1:
        newest = checkpoint.complete_checkpoints(f"{tmp}/corrupt")[0] / checkpoint.shard_name(1)
        newest.write_bytes(newest.read_bytes()[:1000])
    dist.barrier()
    cfg, _ = parse_args(argv + ["--resume"])
    grid = train.build_grid(cfg, rank, world)
    run = train.build_run(cfg, train.validate(cfg, world), grid, torch.device("cpu"))
    resumed = train.checkpoint.load_checkpoint(run)

    real_write = checkpoint.atomic_write

    def full_disk(path, write):
        if rank == 1 and "step_0000003" in str(path):
            raise OSError(28, "No space left on device")
        return real_write(path, write)

    checkpoint.atomic_write = full_disk
    start = time.monotonic()
    try:
        train.main(common + ["--dp", "2", "--out-dir", f"{tmp}/full", "--ckpt-interval", "2"])
        raised = None
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        raised = f"{type(e).__name__}: {e}"
    checkpoint.atomic_write = real_write

    argv = common + ["--dp", "2", "--zero", "1", "--out-dir", f"{tmp}/misfit", "--max-steps", "2"]
    train.main(argv)
    real_restore = checkpoint.restore

    def misfit_on_rank_1(run, shard):
        if rank == 1:
            raise RuntimeError("Error(s) in loading state_dict for GPT: size mismatch")
        return real_restore(run, shard)

    checkpoint.restore = misfit_on_rank_1
    try:
        train.main(argv + ["--resume", "--max-steps", "4"])
        misfit = None
    except SystemExit as e:
        misfit = str(e)
    finally:
        checkpoint.restore = real_restore
    return saved, resumed, (raised, time.monotonic() - start), misfit


def test_two_ranks_agree_when_only_one_is_signalled_or_damaged(data_dir, tmp_path):
    """Cross-rank agreement (MAX of the preemption flag, MIN of the load vote), which a world of
    one cannot test. Without it, a signal to rank 1 alone makes it save while rank 0 trains
    (mismatched collectives: a hang, then this test's timeout), and a shard damaged on rank 1
    alone makes rank 0 resume at step 4 and rank 1 at step 2. The vote runs every
    --vote-interval steps (a plain step makes no sync): the signal after step 3 stops both
    ranks after step 4, the next vote, at dp 2 and at pp 2 (a vote every step would stop at
    3, none at all would train to step 5). A save that fails on rank 1 alone (a full disk)
    stops both ranks at once, each with one error, the checkpoint of step 1 whole. Behind a
    barrier, rank 0 waits: on NCCL until the timeout; here, on gloo, until rank 1's process
    ends and closes its connections, so rank 0 raises gloo's error instead. A ZeRO-1
    checkpoint that fits rank 0 only stops both ranks with one line (before, rank 0 went
    into ZeRO's all-gather inside the restore while rank 1 voted: a hang)."""
    results = run_ranks(_one_rank_of_two_damaged, 2, data_dir, str(tmp_path), timeout=180)
    for saved, resumed, _, _ in results:
        for name in ("dp", "pp"):  # both shards, at once
            assert saved[name] == [("step_0000004", ["rank_00000.pt", "rank_00001.pt"])], name
        assert resumed == 2  # the previous checkpoint (step 1) on both ranks
    # A shard that fits rank 0 only: both stop with one line. Before, rank 0 entered ZeRO's
    # all-gather of the weights inside restore while rank 1 went to the vote (a hang).
    assert [r[3] for r in results] == [
        f"--resume: {tmp_path / 'misfit' / 'checkpoints' / 'step_0000001'} does not fit "
        "this run on some rank (above)"
    ] * 2
    (raised_0, took_0), (raised_1, took_1) = [r[2] for r in results]
    assert raised_0 == "RuntimeError: saving step 3 failed on another rank (its error is above)"
    assert raised_1 == "OSError: [Errno 28] No space left on device"
    assert max(took_0, took_1) < 60, (took_0, took_1)  # 4 steps and a save: seconds
    full = checkpoint.complete_checkpoints(tmp_path / "full")
    assert [c.name for c in full] == ["step_0000001"]
    for name in ("dp", "pp"):
        assert [r["step"] for r in metrics(tmp_path / f"sigterm-{name}")] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------
# Export: one model from a tp=2 x pp=2 checkpoint
# ---------------------------------------------------------------------------------------------
def _sharded_logits(rank, world, data_dir, tmp):
    """Train 2 steps at tp=2 x pp=2, then run the sharded model forward on a fixed batch: stage
    0 sends its activation to stage 1, which gathers its vocab-parallel logits over TP."""
    argv = BASE + ["--data-dir", data_dir, "--out-dir", tmp, "--tp", "2", "--pp", "2",
                   "--micro-batch-size", "4", "--max-steps", "2"]  # fmt: skip
    train.main(argv)
    cfg, _ = parse_args(argv + ["--resume"])  # rebuild it, from its checkpoint
    gpt_config = train.validate(cfg, world)
    run = train.build_run(cfg, gpt_config, train.build_grid(cfg, rank, world), torch.device("cpu"))
    train.checkpoint.load_checkpoint(run)
    x = torch.arange(2 * 32).view(2, 32) % 200  # (B, T) ids
    chunk, grid = run.modules()[0], run.grid
    with torch.no_grad():
        if grid.pp_rank == 0:
            dist.send(chunk(x), dist.get_global_rank(grid.pp_group, 1), group=grid.pp_group)
            return None
        h = torch.empty(2, 32, gpt_config.n_embd)
        dist.recv(h, dist.get_global_rank(grid.pp_group, 0), group=grid.pp_group)
        return train.tp_lib.gather_logits(chunk(h), grid.tp_group), x


def test_export_of_tp2_pp2_gives_one_model_with_the_same_logits(data_dir, tmp_path):
    results = run_ranks(_sharded_logits, 4, data_dir, str(tmp_path), timeout=240)
    sharded, x = results[2]  # global rank 2: pp stage 1, tp rank 0
    model, blob = train.load_exported(tmp_path / "model.pt")
    assert blob["step"] == 1
    logits, _ = model(x)
    V = logits.size(-1)  # 257 tokens: model.pt pads to 320 (64), tp 2 trained 384 (128)
    assert (V, sharded.size(-1)) == (320, 384) and not sharded[..., V:].any(), "TP's: zero"
    # same weights, different reduction order (TP's row-parallel all-reduce): fp32 rounding
    torch.testing.assert_close(logits, sharded[..., :V], rtol=1e-5, atol=1e-5)


def test_model_pt_samples_from_any_directory_after_the_data_is_gone(data_dir, tmp_path):
    """model.pt named its BPE tokenizer by a path relative to the training directory (the
    .tiktoken file in the data folder, as `python 01_data.py` records it), so --sample failed
    from anywhere else, or once the data moved. It now holds the vocab, merges and special
    tokens themselves, as bytes and strings that torch.load(weights_only=True) accepts."""
    text = "".join(f.read_text() for f in sorted((Path(data_dir).parent / "src").iterdir()))
    tok = data.train_bpe(text, 300)
    data_bpe = tmp_path / "data-bpe"
    tok_path = tok.save(data_bpe / "tokenizer")
    data.prepare(str(Path(data_dir).parent / "src"), tok, data_bpe, block_size=32,
                 tokenizer_name=os.path.relpath(tok_path))  # fmt: skip
    run_dir = tmp_path / "run"
    run_main(BASE + ["--data-dir", str(data_bpe), "--out-dir", str(run_dir), "--max-steps", "1"])
    shutil.rmtree(data_bpe)
    sampled = subprocess.run([sys.executable, str(ROOT / "train.py"), "--sample", "model.pt",
                              "--sample-tokens", "8", "--prompt", "def f"], cwd=run_dir,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("def f")
    blob = torch.load(run_dir / "model.pt", weights_only=True)
    assert blob["tokenizer"]["merges"] == tok.merges  # the BPE itself, not the name "char"


def test_an_older_model_pt_whose_config_holds_recompute_still_samples(tmp_path):
    """model.pt files written before GPTConfig lost its recompute field hold
    "recompute": "none" in model_config; GPTConfig(**model_config) raised TypeError on them.
    load_exported drops the key, as the export from a checkpoint does."""
    model = train.new_model(train.model_lib.GPTConfig.from_preset("tiny").__dict__)
    path = export_lib.write_model_pt(tmp_path / "model.pt", model, 7, "char")
    blob = torch.load(path, weights_only=True)
    blob["model_config"]["recompute"] = "none"  # as an older train.py saved it
    torch.save(blob, path)
    loaded, blob = train.load_exported(path)
    assert blob["step"] == 7 and not hasattr(loaded.config, "recompute")
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert train.sample(path, "def f", 8).startswith("def f")


# ---------------------------------------------------------------------------------------------
# Bad configurations and the main job
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--dp", "2"], 1, "world_size=1 but --dp 2 x --cp 1 x --tp 1 x --pp 1 = 2"),
        (["--tp", "3", "--dp", "1"], 3, "--tp 3 does not divide --n-head 2 (--model tiny's)"),
        (["--pp", "8"], 8, "--pp 8 --virtual-stages 1 --n-layer 4: n_layer=4 blocks cannot fill"),
        (["--micro-batch-size", "3"], 1, "--batch-size 8 is not divisible into microbatches"),
        (["--dp", "2", "--batch-size", "6", "--micro-batch-size", "2"], 2,
         "--batch-size 6 is not divisible into microbatches of --micro-batch-size 2 x --dp 2"),
        (["--schedule", "zigzag"], 1, "--schedule zigzag --pp 1 --virtual-stages 1 --n-layer 4: "
         "unknown schedule 'zigzag'"),
        (["--pp", "2", "--virtual-stages", "2"], 2, "--schedule 1f1b --pp 2 --virtual-stages 2 "
         "--n-layer 4: virtual_stages=2 > 1 needs schedule='interleaved'"),
        (["--pp", "2", "--virtual-stages", "2", "--schedule", "interleaved", "--micro-batch-size",
          "8"], 2, "interleaved needs microbatches divisible by pp_size (m=1, p=2)"),
        # --block-size above the preset's 32 positions trains now: tests/test_long_context.py.
        (["--data-dir", "/no/such/dir"], 1, "run `python 01_data.py --out /no/such/dir`"),
        (["--dropout", "1.5"], 1, "--dropout 1.5: a probability, in [0, 1)"),
        (["--n-layer", "-1"], 1, "--n-layer must be >= 0, got -1"),
        (["--lr", "-1"], 1, "--lr must be > 0, got -1.0"),
        (["--lr", "nan"], 1, "--lr must be > 0, got nan"),
        (["--grad-clip", "-1"], 1, "--grad-clip must be >= 0, got -1.0"),
        (["--warmup-steps", "-1"], 1, "--warmup-steps must be >= 0, got -1"),
        (["--eval-interval", "-1"], 1, "--eval-interval must be >= 0, got -1"),
        (["--ckpt-interval", "-1"], 1, "--ckpt-interval must be >= 0, got -1"),
        (["--steps-this-run", "-1"], 1, "--steps-this-run must be >= 0, got -1"),
        (["--dp", "-1", "--tp", "-1"], 1, "--dp must be > 0, got -1"),  # (-1)(-1)(1) = world 1
        (["--batch-size", "8192", "--micro-batch-size", "8192"], 1,
         "train split: DATA/train: 1 shard(s) hold 4008 windows of 32+1 tokens, but one step needs"),
        (["--out-dir", "DATA/meta.json/run"], 1, "DATA/meta.json is a file, not a folder"),
        (["--zero", "1"], 1, "--zero shards over DP x CP, but --dp x --cp is 1"),
        (["--dp", "2", "--zero", "4"], 2, "--zero 4: a stage is 0 to 3"),
        (["--dp", "2", "--pp", "2", "--zero", "3"], 4,
         "--zero 3 with --pp: a stage re-gathers every block for every microbatch"),
        (["--sequence-parallel"], 1, "--sequence-parallel shards over TP ranks, but --tp is 1"),
        (["--virtual-stages", "2", "--schedule", "interleaved"], 1, "but --pp is 1"),
        (["--tokenizer", "gpt2"], 1, "--tokenizer gpt2, but --data-dir DATA was prepared with"),
        (["--tokenizer", "sentencepiece"], 1, "use one of bpe, gpt2, char"),
        (["--lr-schedule", "step"], 1, "--lr-schedule step: use one of cosine, wsd, cyclic, constant"),
        (["--decay-fraction", "0"], 1, "--decay-fraction 0.0: a fraction of the run, in (0, 1]"),
        (["--cycle-steps", "0"], 1, "--cycle-steps must be > 0, got 0"),
        (["--grad-compression", "fp16"], 1, "--grad-compression compresses DP's all-reduce, but"),
        (["--grad-compression", "zip"], 1, "--grad-compression zip: use one of none, fp16, bf16"),
        (["--dp", "2", "--zero", "2", "--grad-compression", "fp16"], 2,
         "--grad-compression with --zero 2: ZeRO reduce-scatters"),
        (["--dp", "2", "--grad-compression", "powersgd", "--dtype", "fp16"], 2,
         "--grad-compression powersgd with --dtype fp16: an overflowed step's inf would stay"),
        (["--powersgd-rank", "0"], 1, "--powersgd-rank must be > 0, got 0"),
        (["--dp", "2", "--powersgd-warmup-steps", "3"], 2,
         "--powersgd-warmup-steps needs --grad-compression powersgd"),
        (["--tp", "2", "--loss", "chunked"], 2,
         "--loss chunked with --tp 2: a rank holds V/tp logit columns, whose max and sum need"),
        (["--loss", "fused"], 1, "--loss fused: use one of plain, chunked"),
    ],
    ids=["world-size", "n_head", "n_layer", "microbatches", "microbatches-x-dp",
         "schedule-unknown",
         "virtual-needs-interleaved", "interleaved-microbatches", "data-dir", "dropout",
         "n-layer", "lr", "lr-nan", "grad-clip", "warmup", "eval-interval", "ckpt-interval",
         "steps-this-run", "negative-sizes", "batch-over-data", "out-dir-file", "zero-at-dp1",
         "zero-4", "zero3-with-pp",
         "sp-at-tp1", "virtual-at-pp1", "tokenizer-mismatch", "tokenizer-unknown",
         "lr-schedule", "decay-fraction", "cycle-steps", "compression-at-dp1", "compression-unknown",
         "compression-with-zero", "powersgd-fp16", "powersgd-rank", "powersgd-flag-alone",
         "chunked-loss-with-tp", "loss-unknown"],
)  # fmt: skip
def test_bad_configurations_fail_fast_with_one_line(data_dir, argv, world, message):
    """Each bad flag is one line naming it, from validate(), before any process group. "DATA"
    stands for the data folder (a file inside it: meta.json)."""
    argv = [a.replace("DATA", data_dir) for a in argv]
    cfg, _ = parse_args(BASE + ["--data-dir", data_dir] + argv)
    with pytest.raises(train.ConfigError) as err:
        train.validate(cfg, world)
    message = message.replace("DATA", data_dir)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_rank_that_never_sees_the_default_data_says_why(tmp_path, monkeypatch):
    """Rank 1 waits for rank 0 to prepare the default data; on a disk that node cannot see
    (or after rank 0 failed) it never comes: one line naming the folder and the fix."""
    monkeypatch.chdir(tmp_path)  # no data/ here
    monkeypatch.setattr(train.config, "PREPARE_WAIT_S", 0)
    cfg, _ = parse_args(["--model", "tiny", "--tokenizer", "char"])
    with pytest.raises(train.ConfigError, match="rank 1 waited 0 s for .*meta.json: use a"):
        train.config.prepare_default_data(cfg, 1, prepare=None)


def test_a_tp_that_splits_no_head_is_refused_before_any_data_is_made(monkeypatch):
    """`torchrun --nproc_per_node=3 train.py --tp 3` ('small' has 4 heads): one line before
    01 prepares the default data, which took 25 s and wrote data/ before the model's check."""
    made = []
    monkeypatch.setattr(train.config, "prepare_default_data", lambda *a: made.append(a))
    cfg, _ = parse_args(["--model", "small", "--tp", "3"])
    with pytest.raises(train.ConfigError, match="--tp 3 does not divide --n-head 4"):
        train.validate(cfg, 3)
    assert made == [], "the default data was prepared before the flags were all checked"


def test_resume_with_other_batches_or_a_fresh_run_over_old_ones_is_refused(data_dir, tmp_path):
    run_main(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "1"])
    cfg, _ = parse_args(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path),
                                      "--resume", "--tp", "2"])  # fmt: skip
    train.validate(cfg, 2)  # another layout resumes: support/train/checkpoint cuts its pieces anew
    changed = [(["--lora-rank", "4"], "--lora-rank 0, this run has --lora-rank 4"),
               (["--seed", "7"], "--seed 1337, this run has --seed 7"),  # these passed silently
               (["--batch-size", "16"], "--batch-size 8, this run has --batch-size 16"),
               (["--micro-batch-size", "4"], "--micro-batch-size 8, this run has "),
               (["--block-size", "16"], "--block-size 0, this run has --block-size 16"),
               (["--grad-compression", "fp16"], "--grad-compression none, this run has --grad"),
               (["--powersgd-rank", "8"], "--powersgd-rank 4, this run has --powersgd-rank 8"),
               ]  # fmt: skip
    meta = next(tmp_path.glob("checkpoints/step_*")) / "meta.json"  # from before a flag existed:
    old = json.loads(meta.read_text())
    del old["config"]["powersgd_rank"]  # its default, 4, stands in
    meta.write_text(json.dumps(old))
    for argv, message in changed:
        cfg, _ = parse_args(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path),
                                          "--resume"] + argv)  # fmt: skip
        with pytest.raises(train.ConfigError) as err:
            checkpoint.check_resume_layout(cfg)
        assert message in str(err.value) and "\n" not in str(err.value), argv
    fresh, _ = parse_args(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path)])
    with pytest.raises(train.ConfigError, match="already holds checkpoints .* pass --resume"):
        train.validate(fresh, 1)  # a second run without --resume would mix two runs' files


def test_a_bad_flag_exits_at_once_with_its_message(data_dir):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "train.py", "--dp", "2", "--data-dir", data_dir],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("train.py: error: world_size=1")
    assert time.monotonic() - start < 30


def test_help_lists_the_presets_and_every_recompute_mode(capsys):
    """--model's help lists 02's PRESETS (no hard-coded list to go stale) and --recompute's
    all of 06b's RECOMPUTE, "none" included."""
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    presets = ", ".join(train.model_lib.PRESETS)
    preset = "02_model.py's preset (not given: --init-from's shape)"
    assert f"--model MODEL {preset}: {presets} (default: small)" in text
    assert "(06b): none, selective, full (default: none)" in text
    assert "plain until a GPU measurement favours chunked (default: plain)" in text


def test_the_main_job_runs_end_to_end(data_dir, tmp_path):
    """`python train.py` on a tiny setting: it logs, evaluates, checkpoints, exports, plots and
    samples, and the validation loss falls."""
    args = ["train.py", "--model", "tiny", "--data-dir", data_dir, "--out-dir", str(tmp_path),
            "--max-steps", "40", "--batch-size", "16", "--micro-batch-size", "16",
            "--eval-interval", "15", "--eval-steps", "2",
            "--sample-tokens", "30"]  # fmt: skip
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    val = [r["val_loss"] for r in metrics(tmp_path, "val")]
    assert len(val) == 4 and val[-1] < val[0] - 0.3, val  # steps 0, 15, 30 and the end
    for row in metrics(tmp_path):
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= row.keys()
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "model.pt").is_file()
    assert "--- sample (30 tokens) ---" in out.stdout
    sampled = subprocess.run([sys.executable, "train.py", "--sample", str(tmp_path / "model.pt"),
                              "--sample-tokens", "10"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert sampled.returncode == 0 and sampled.stdout.startswith("def "), sampled.stderr


def test_a_checkpoint_of_another_model_stops_the_run_in_one_line(data_dir, tmp_path, capsys):
    """A shard that loads but belongs to another model (here 4 blocks, resumed with 2) is no
    damage to fall back from: every rank votes after restoring, and all stop with one line,
    instead of one rank raising mid-restore while its peers walk into the next collective and
    hang (and instead of a traceback at one process)."""
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "1"]
    run_main(argv)
    # checkpoint.check_resume_shape reads meta.json's shape up front (a one-line error there:
    # tests/test_train_shape.py): told 2 blocks, it lets the restore meet the shards' 4.
    meta = next(tmp_path.glob("checkpoints/step_*")) / "meta.json"
    saved = json.loads(meta.read_text())
    saved["model_config"]["n_layer"] = 2
    meta.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="does not fit this run"):
        run_main(argv[:2] + ["--n-layer", "2"] + argv[4:] + ["--resume"])
    assert "does not fit this run" in capsys.readouterr().out
