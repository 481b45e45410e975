"""train.py, one step at a time: the LR schedule at its edges, clipping that never scales up,
evaluation under DP, TP and PP equal to one process's, dropout streams per rank, the model's
context, and bad input that fails in one line having written nothing."""

import dataclasses
import hashlib
import importlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from support.train import checkpoint
from support.train.command_line import parse_args
from tests.distributed import run_ranks
from tests.test_finetune import FLAGS as FINETUNE_FLAGS
from tests.test_finetune import checkpoint as snapshot  # noqa: F401 (a fixture)
from tests.test_finetune import gpt2_data  # noqa: F401 (a fixture)
from tests.test_train import BASE, assert_same_curve, data_dir, metrics, run_main  # noqa: F401

train = importlib.import_module("train")


def build(argv, rank, world):
    """A Run as train.main builds it, without training: (cfg, run)."""
    cfg, _ = parse_args(argv)
    gpt_config = train.validate(cfg, world, rank)
    grid = train.build_grid(cfg, rank, world)
    return cfg, train.build_run(cfg, gpt_config, grid, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# The learning rate: derived by hand
# ---------------------------------------------------------------------------------------------
def test_lr_schedule_at_the_warmup_and_decay_edges():
    """lr 6, min_lr 1, 10 warm-up steps, 110 steps (0..109). Warm-up is linear and reaches the
    peak on its last step: lr(s) = 6 (s+1)/10, so 0.6 at step 0 (not 0: no wasted step) and 6
    at step 9. Then cosine from 6 to 1 over the 99 steps 10..109: lr = 1 + 2.5 (1 + cos(pi
    (s-10)/99)), so 6 at step 10, 1 + 2.5 x 1.5 = 4.75 at 43 (a third: cos(pi/3) = 1/2), and 1
    (min_lr) at the last step trained, 109, never below, never rising again. Catches an
    off-by-one warm-up (0 at step 0, or the peak a step late), a decay that starts at min_lr,
    overshoots past max_steps, or reaches min_lr only at step 110, which never trains."""
    cfg, _ = parse_args(["--lr", "6", "--min-lr", "1", "--warmup-steps", "10",
                               "--max-steps", "110"])  # fmt: skip
    expected = {0: 0.6, 4: 3.0, 9: 6.0, 10: 6.0, 43: 4.75, 109: 1.0, 110: 1.0, 111: 1.0,
                10_000: 1.0}  # fmt: skip
    for step, lr in expected.items():
        assert train.lr_at(cfg, step) == pytest.approx(lr, rel=1e-12), f"step {step}"  # float math
    cfg.warmup_steps = 0  # no warm-up: the peak at step 0, no division by zero
    assert train.lr_at(cfg, 0) == pytest.approx(6.0, rel=1e-12)


@pytest.mark.parametrize(
    "schedule, extra, expected",
    [  # WSD: decay round(0.2 x 110) = 22 steps, 87..109: lr = 1 + 5 (1 - (s - 87)/22)
     ("wsd", [], {9: 6.0, 10: 6.0, 60: 6.0, 86: 6.0, 87: 6.0, 98: 3.5, 108: 1 + 5 / 22,
                  109: 1.0, 110: 1.0, 500: 1.0}),
     # WSD with decay 1: linear from the warm-up's end (10..109), never before it
     ("wsd", ["--decay-fraction", "1"], {9: 6.0, 10: 6.0, 43: 1 + 5 * 2 / 3, 109: 1.0}),
     # WSD with a decay of round(0.11) steps: one, not none: the last step trained is at min_lr
     ("wsd", ["--decay-fraction", "0.001"], {107: 6.0, 108: 6.0, 109: 1.0, 500: 1.0}),
     # cyclic, 20 steps a triangle from 10: 6 at 10, 30, 50; 1 at 20, 40; rising 0.5 a step
     ("cyclic", ["--cycle-steps", "20"], {9: 6.0, 10: 6.0, 15: 3.5, 20: 1.0, 25: 3.5, 30: 6.0,
                                         40: 1.0, 109: 5.5, 1000: 1.0}),  # 109: a step below a top
     ("constant", [], {0: 0.6, 9: 6.0, 10: 6.0, 109: 6.0, 10_000: 6.0})],
    ids=["wsd", "wsd-decay-1", "wsd-decay-tiny", "cyclic", "constant"],
)  # fmt: skip
def test_the_other_schedules_at_their_edges(schedule, extra, expected):
    """The same lr 6, min_lr 1, 10 warm-up steps and 110 steps (warm-up as above: 0.6 at 0, 6 at
    9). Catches a decay that starts a step early or late, ends above min_lr, a triangle that
    starts at its bottom (a jump after the warm-up) or has the wrong period."""
    cfg, _ = parse_args(["--lr", "6", "--min-lr", "1", "--warmup-steps", "10",
                               "--max-steps", "110", "--lr-schedule", schedule, *extra])  # fmt: skip
    for step, lr in expected.items():
        assert train.lr_at(cfg, step) == pytest.approx(lr, rel=1e-12), f"step {step}"


# ---------------------------------------------------------------------------------------------
# Evaluation and clipping under dp=2, tp=2, pp=2 (one spawned world of 2 for all of them)
# ---------------------------------------------------------------------------------------------
def _clipped_norms(argv, rank, world):
    """Step 0 with --grad-clip 1000 (far above the norm, ~4), step 1 with 0.01 (far below):
    (pre-clip norm, norm of the gradients the optimizer got) for each, on this rank."""
    cfg, run = build(argv + ["--grad-clip", "1000"], rank, world)
    got = []
    for step, clip in ((0, 1000.0), (1, 0.01)):
        cfg.grad_clip = clip
        norm = train.train_step(run, step)["grad_norm"]  # .grad holds what AdamW used
        got.append((norm, train.global_grad_norm(run, train.gradients(run)).item()))
    return got


def _evaluate_and_clip(rank, world, data, tmp, layouts):
    """Per layout: a 4-step run evaluating at steps 0, 2 and the end; then the clipping steps."""
    out = []
    for name, extra in layouts:
        argv = BASE + ["--data-dir", data, "--eval-interval", "2"] + extra
        train.main(argv + ["--out-dir", f"{tmp}/{name}"])
        clipped = _clipped_norms(argv + ["--out-dir", f"{tmp}/{name}-clip"], rank, world)
        dist.barrier()
        rows = (metrics(f"{tmp}/{name}"), metrics(f"{tmp}/{name}", "val")) if rank == 0 else None
        out.append((rows, clipped))
    return out


@pytest.fixture(scope="module")
def reference_with_eval(data_dir, tmp_path_factory):  # noqa: F811 (data_dir: the fixture)
    """One process, the batch of 8 as one microbatch, evaluating at steps 0, 2 and the end."""
    out = tmp_path_factory.mktemp("ref-eval")
    argv = BASE + ["--data-dir", data_dir, "--eval-interval", "2", "--micro-batch-size", "8"]
    run_main(argv + ["--out-dir", str(out)])
    return metrics(out), metrics(out, "val")


def test_evaluation_and_clipping_under_dp_tp_pp_equal_one_process(data_dir, tmp_path,  # noqa: F811
                                                                  reference_with_eval):  # fmt: skip
    """Catches: an evaluation that forgets the SUM over DP or PP, divides by m or dp twice, or
    evaluates only one replica's share (every multi-rank test ran with evaluation off before);
    clipping that scales gradients up when the norm is below --grad-clip, or clips each rank by
    its own shard's norm (ZeRO: its pieces of the shards); the fp16 pipeline's gradient norm measured on scaled gradients."""
    ref_train, ref_val = reference_with_eval
    layouts = [
        ("dp2", ["--dp", "2", "--micro-batch-size", "2"]),
        ("dp2-zero1", ["--dp", "2", "--micro-batch-size", "2", "--zero", "1"]),  # the shards
        ("dp2-zero3", ["--dp", "2", "--micro-batch-size", "2", "--zero", "3"]),  # clipped
        ("tp2", ["--tp", "2", "--micro-batch-size", "4"]),
        ("pp2-fp16", ["--pp", "2", "--micro-batch-size", "2", "--dtype", "fp16"]),
    ]
    results = run_ranks(_evaluate_and_clip, 2, data_dir, str(tmp_path), layouts, timeout=240)
    assert [r["step"] for r in ref_val] == [0, 2, 3]  # the baseline, the interval, the end
    for (name, _), (rows, _) in zip(layouts, results[0]):
        got_train, got_val = rows
        assert [r["step"] for r in got_val] == [0, 2, 3], name
        if name.endswith("fp16"):
            # autocast rounds matmul inputs to 11 bits (2^-11 relative); the loss and the norm,
            # measured on unscaled fp32 gradients, move by ~1e-4 here: rtol 2e-3 leaves room
            # and still catches a norm of scaled gradients (x 65536) or a missed 1/m (x 2)
            for key, got, ref in (("loss", got_train, ref_train), ("grad_norm", got_train,
                                  ref_train), ("val_loss", got_val, ref_val)):  # fmt: skip
                torch.testing.assert_close(torch.tensor([r[key] for r in got]),
                                           torch.tensor([r[key] for r in ref]), rtol=2e-3, atol=0,
                                           msg=lambda m, k=key, n=name: f"{n}, {k}: {m}")  # fmt: skip
            continue
        assert_same_curve(got_train, ref_train, name)
        # the same fp32 rounding argument as assert_same_curve: ~1e-6 relative, bugs >= 1e-2
        torch.testing.assert_close(torch.tensor([r["val_loss"] for r in got_val]),
                                   torch.tensor([r["val_loss"] for r in ref_val]), rtol=1e-4,
                                   atol=1e-5, msg=lambda m, n=name: f"{n}, val: {m}")  # fmt: skip
    for (name, _), *ranks in zip(layouts, *results):
        for rank, (_, ((norm0, used0), (_, used1))) in enumerate(ranks):
            where = f"{name}, rank {rank}"
            # below the threshold the coefficient is exactly 1.0: the gradients are untouched
            assert used0 == norm0, f"{where}: clip 1000 changed a norm of {norm0} to {used0}"
            # above it they are scaled to the clip value: c / (norm + 1e-6) * norm = c (1 - 1e-6
            # / norm), plus fp32 rounding of the norm (~1e-6): rel 1e-4
            assert used1 == pytest.approx(0.01, rel=1e-4), f"{where}: clip 0.01 gave {used1}"


def test_clipping_on_one_process_scales_down_only(data_dir, tmp_path):  # noqa: F811
    """The same two clipping steps in a world of one (see _clipped_norms)."""
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path)]
    (norm0, used0), (_, used1) = _clipped_norms(argv, 0, 1)
    assert used0 == norm0, f"clip 1000 changed a norm of {norm0} to {used0}"  # coefficient 1.0
    assert used1 == pytest.approx(0.01, rel=1e-4), used1  # as in the test above


# ---------------------------------------------------------------------------------------------
# Dropout streams and replicas in sync (one spawned world of 4)
# ---------------------------------------------------------------------------------------------
def mask_hash() -> str:
    """The hash of the dropout mask the default generator gives a (64,) activation now."""
    mask = F.dropout(torch.ones(64), 0.5, training=True) != 0
    return hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:12]


def max_difference(p: torch.Tensor, group, size: int) -> float:
    """The largest |difference| between this parameter's copies over a group."""
    copies = [torch.empty_like(p) for _ in range(size)]
    dist.all_gather(copies, p.detach(), group=group)
    return max((c - copies[0]).abs().max().item() for c in copies)


def _streams_and_sync(rank, world, data, tmp):
    """For tp2 x pp2 and dp2 x tp2: this rank's (pp, dp, tp) and the hashes of the masks its
    replicated regions (the default generator) and sharded ones (04's tracker) would draw. Then
    3 steps of dp2 x tp2 with dropout 0.1: how far apart are TP peers' replicated parameters and
    DP replicas' parameters (all of them)?"""
    hashes = {}
    for name, extra in (("tp2-pp2", ["--tp", "2", "--pp", "2"]),
                        ("dp2-tp2", ["--dp", "2", "--tp", "2"])):  # fmt: skip
        argv = BASE + ["--data-dir", data, "--out-dir", f"{tmp}/{name}", "--dropout", "0.1",
                       "--micro-batch-size", "2"] + extra  # fmt: skip
        _, run = build(argv, rank, world)
        g = run.grid
        with run.modules()[0].tp_rng.fork():
            sharded = mask_hash()
        hashes[name] = ((g.pp_rank, g.dp_rank, g.tp_rank), mask_hash(), sharded)
    for step in range(3):  # the dp2 x tp2 run, built last
        train.train_step(run, step)
    params = list(run.modules()[0].parameters())
    replicated = [p for p in params if not getattr(p, "tensor_parallel", False)]
    tp_diff = max(max_difference(p, g.tp_group, g.tp) for p in replicated)
    dp_diff = max(max_difference(p, g.dp_group, g.dp) for p in params)
    return hashes, tp_diff, dp_diff, len(replicated)


def test_dropout_streams_per_rank_and_replicas_in_sync(data_dir, tmp_path):  # noqa: F811
    """Replicated regions: the same masks on TP peers (their activations are copies), different
    ones on other stages and replicas. Sharded regions: a different mask on every rank. Catches
    the tracker seeded by TP rank alone (the same attention-dropout masks on every stage and
    replica), a default stream that differs across TP peers (their replicated parameters drift
    apart, checked after 3 steps with dropout on), and DP replicas that drift."""
    results = run_ranks(_streams_and_sync, 4, data_dir, str(tmp_path), timeout=240)
    for name in ("tp2-pp2", "dp2-tp2"):
        ranks = [r[0][name] for r in results]  # ((pp, dp, tp), replicated, sharded) per rank
        for coords, replicated, sharded in ranks:
            for other, other_replicated, other_sharded in ranks:
                if other == coords:
                    continue
                same_place = other[:2] == coords[:2]  # same stage and replica: TP peers
                assert (replicated == other_replicated) == same_place, (name, coords, other)
                assert sharded != other_sharded, f"{name}: {coords} and {other} share masks"
            assert sharded != replicated, f"{name}: {coords}'s two streams are one"
    for rank, (_, tp_diff, dp_diff, n_replicated) in enumerate(results):
        assert n_replicated > 0  # LayerNorms, wpe, row-parallel biases: something was compared
        assert tp_diff == 0.0, f"rank {rank}: TP peers' replicated parameters differ by {tp_diff}"
        assert dp_diff == 0.0, f"rank {rank}: DP replicas' parameters differ by {dp_diff}"


# ---------------------------------------------------------------------------------------------
# Tensor parallelism at any tp that divides the heads: the vocabulary padded to 64 x tp
# ---------------------------------------------------------------------------------------------
# GPT-2's 12 heads in one block of 32 tokens: the smallest preset whose heads split over 3.
TWELVE_HEADS = ["--model", "gpt2", "--n-layer", "1", "--block-size", "32", "--micro-batch-size",
                "8"]  # fmt: skip


def two_steps(rank, world, argv):
    """Steps 0 and 1 of a Run built as train.main builds it: [(loss, grad_norm)] as floats,
    the padded vocabulary, and this rank's rows of wte."""
    cfg, run = build(argv, rank, world)
    got = []
    for step in range(2):
        stats = train.train_step(run, step)
        got.append((float(stats["loss"]), float(stats["grad_norm"])))
    run.train.close()
    return got, run.gpt_config.padded_vocab_size, len(run.modules()[0].transformer.wte.weight)


def test_tp_3_trains_as_one_process_though_3_does_not_divide_64_rows(data_dir, tmp_path):  # noqa: F811
    """The char data's 257 tokens pad to 320 rows (5·64), which 3 ranks cannot split: before,
    --tp 3 failed ("the vocabulary has 320 rows"), as gpt2-xl's 25 heads ran at tp 1 only.
    Padded to a multiple of 64·3 (support/train/vocab), 384 rows, each rank holds 128; the 64 rows TP
    added are zero and the 320 keep one process's init, so two steps equal one process's
    (fp32: assert_same_curve's tolerance; a different init is off by > 1e-2)."""
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path)] + TWELVE_HEADS
    ref, rows, _ = two_steps(0, 1, argv)
    assert rows == 320
    results = run_ranks(two_steps, 3, argv + ["--tp", "3"], timeout=240)
    for got, rows, held in results:
        assert (rows, held) == (384, 128)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The model's context, and bad input
# ---------------------------------------------------------------------------------------------
def test_the_model_context_is_the_trained_block_size(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """--block-size 16 on the tiny preset (32 positions): the exported model has 16 positions,
    so a 40-token sample crops its context and reads positions 0..15 only. Catches validate's
    GPTConfig ignoring --block-size: a 32-position model whose positions 16..31 keep their random
    init, read as soon as the sample passes 16 tokens."""
    run_main(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--block-size", "16",
                     "--max-steps", "1"])  # fmt: skip
    model, blob = train.load_exported(tmp_path / "model.pt")
    assert blob["model_config"]["block_size"] == 16 and model.transformer.wpe.num_embeddings == 16
    read, real = [], train.load_exported

    def spy(path):  # sample() loads the model through load_exported: watch its wpe lookups
        model, blob = real(path)
        wpe = model.transformer.wpe
        wpe.register_forward_pre_hook(lambda mod, args: read.append(int(args[0].max())))
        return model, blob

    monkeypatch.setattr(train, "load_exported", spy)
    train.sample(tmp_path / "model.pt", "\n", 40)
    assert len(read) == 40 and max(read) == 15, f"positions read: up to {max(read)}"


def test_bad_input_is_one_line_before_anything_is_written(data_dir, tmp_path,  # noqa: F811
                                                          monkeypatch):  # fmt: skip
    """train.main with a bad flag (the default data missing) and with a batch larger than the
    data: one line, SystemExit (no traceback), no process group, no data prepared, no --out-dir.
    Catches the default data being prepared (~30 s, files written) before the flags are read,
    and the loader's error surfacing as a traceback after the process group started."""
    monkeypatch.chdir(tmp_path)  # the default --data-dir, data/stdlib-char, would go here
    for argv, message in (
        (["--tokenizer", "char", "--dropout", "1.5"], "--dropout 1.5: a probability, in [0, 1)"),
        (["--data-dir", data_dir, "--batch-size", "8192", "--micro-batch-size", "8192"],
         "one step needs dp_size*batch_size = 8192"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as err:
            train.main(argv + ["--out-dir", "run"])
        line = str(err.value.code)
        assert line.startswith("train.py: error: ") and message in line and "\n" not in line
        assert not dist.is_initialized()
        assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_default_data_that_cannot_be_prepared_is_one_train_line(tmp_path, monkeypatch):
    """01's main reports bad input as SystemExit("01_data.py: error: ..."); train.py must turn it
    into its own one-line error rather than let 01's exit pass as train.py's. Catches an except
    clause that waits for a RuntimeError 01 no longer raises (gpt2's files offline, say)."""
    monkeypatch.chdir(tmp_path)

    def offline(argv):
        raise SystemExit("01_data.py: error: cannot load gpt2's tokenizer files offline")

    monkeypatch.setattr(train.data_lib, "main", offline)
    with pytest.raises(SystemExit) as err:
        train.main(["--tokenizer", "gpt2", "--out-dir", "run"])
    assert str(err.value.code) == "train.py: error: cannot load gpt2's tokenizer files offline"
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Branches written for CUDA, run on the CPU through the same code (docs/cluster.md: the branches only CUDA runs)
# ---------------------------------------------------------------------------------------------
def test_auto_dtype_is_bf16_only_on_a_gpu_that_has_it(monkeypatch):
    """resolve_dtype's CUDA branch with the GPU's answer faked: bf16 where the card supports it
    (Ampere and later), fp32 on an older card and on the CPU; an explicit --dtype always wins."""
    cfg, _ = parse_args([])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert train.resolve_dtype(cfg, cuda) == torch.bfloat16
    assert train.resolve_dtype(cfg, cpu) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert train.resolve_dtype(cfg, cuda) == torch.float32
    cfg.dtype = "fp16"
    assert train.resolve_dtype(cfg, cuda) == torch.float16


def test_the_fused_adamw_of_cuda_runs_on_the_cpu_and_equals_the_plain_one(data_dir, tmp_path):  # noqa: F811
    """data_parallel asks for fused AdamW on CUDA. Torch has a fused CPU kernel too, so the
    same branch (fused=True, our groups, betas and eps) runs here on the CPU parameters: three
    steps land where the plain AdamW lands. Tolerance: the fused kernel orders its float32
    arithmetic differently, ~1e-7 relative per step; a wrong beta or eps is off by far more."""
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path)]
    params = []
    for device in ("cuda", "cpu"):  # "cuda": only the optimizer's choice; the tensors stay CPU
        cfg, run = build(argv, 0, 1)
        _, optimizer, _ = train.data_parallel(cfg, run.modules(), run.grid, torch.device(device))
        assert optimizer.defaults["fused"] is (device == "cuda")
        run.optimizer = run.scaled = optimizer
        for step in range(3):
            train.train_step(run, step)
        params.append([p.detach().clone() for p in run.modules()[0].parameters()])
    for fused, plain in zip(*params):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_recompute_wraps_every_block_and_keeps_less_for_the_backward(data_dir, tmp_path):  # noqa: F811
    """--recompute reaches the model: build_run wraps every Block's forward in 06b's
    _recomputed with the flag's mode ("none": no wrapper), and one forward then keeps fewer
    bytes for its backward, full < selective < none (06b's saved_activation_bytes).
    test_recomputation_changes_no_bit_on_any_layout only compares results, which a train.py
    that forgot apply_recomputation would also pass; this fails then."""
    mp = train.recompute_lib
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path)]
    kept = {}
    for mode in mp.RECOMPUTE:
        cfg, run = build(argv + ["--recompute", mode], 0, 1)
        model = run.modules()[0]
        blocks = [m for m in model.modules() if isinstance(m, train.model_lib.Block)]
        assert len(blocks) == 4
        for block in blocks:
            wrapper = block.__dict__.get("forward")
            if mode == "none":
                assert wrapper is None
            else:
                assert wrapper.func is mp._recomputed and wrapper.args == (block, mode)
        x = torch.randint(0, run.gpt_config.vocab_size, (2, 32))
        _, kept[mode] = mp.saved_activation_bytes(lambda m=model, x=x: m(x, x)[1])
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_only_rank_0_reads_the_data_folder_and_only_after_the_shards(data_dir, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    """save_checkpoint's meta.json names the data folder's tokenizer (tokenizer_name reads the
    folder's meta.json). Only rank 0 reads it, once every shard is written: a rank failing
    there before a barrier left the others waiting out the timeout. Here rank 1 of a world of
    one (no barriers) saves without reading, and rank 0 reads once, its shard already on disk."""
    cfg, run = build(BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path)], 0, 1)
    calls = []
    real = checkpoint.tokenizer_name

    def spy(folder):
        calls.append(sorted(p.name for p in checkpoint.ckpt_root(tmp_path).glob("*/*.pt")))
        return real(folder)

    monkeypatch.setattr(checkpoint, "tokenizer_name", spy)
    (checkpoint.ckpt_root(tmp_path) / "step_0000000.partial").mkdir(parents=True)
    run.grid = dataclasses.replace(run.grid, rank=1)
    checkpoint.save_checkpoint(run, 0)
    assert calls == []
    run.grid = dataclasses.replace(run.grid, rank=0)
    checkpoint.save_checkpoint(run, 0)
    assert calls == [[checkpoint.shard_name(0)]]
    assert json.loads((checkpoint.complete_checkpoints(tmp_path)[0] / "meta.json").read_text())


def _compiled_zero3(rank, world, argv):
    train.main(argv)
    return metrics(argv[argv.index("--out-dir") + 1]) if rank == 0 else None


def test_compile_trains_like_eager(data_dir, tmp_path):  # noqa: F811
    """--compile compiles each chunk in place (inductor; on a GPU it emits Triton, here C++):
    the same losses as eager over three steps, and checkpoint names unchanged (the run exports).
    Then with ZeRO-3 at dp 2, whose unit hooks free and regrow storage (inductor cannot lower
    that: 03 runs them eagerly, and before it did the first step crashed).
    Slow (~40 s of compilation on 2 cores each), but it is the only proof that the flag works.
    Tolerance: fused kernels reassociate float32 sums, ~1e-7 relative; a bug is off by 1e-2.
    At dp 2 the reduction order changes too: assert_same_curve's tolerance."""
    argv = BASE + ["--data-dir", data_dir, "--max-steps", "3"]
    run_main(argv + ["--out-dir", str(tmp_path / "eager")])
    run_main(argv + ["--out-dir", str(tmp_path / "compiled"), "--compile"])
    eager, compiled = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    torch.testing.assert_close(torch.tensor([r["loss"] for r in compiled]),
                               torch.tensor([r["loss"] for r in eager]), rtol=1e-5, atol=1e-6)  # fmt: skip
    assert (tmp_path / "compiled" / "model.pt").is_file()
    zero3 = argv + ["--out-dir", str(tmp_path / "zero3"), "--compile", "--dp", "2", "--zero", "3",
                    "--micro-batch-size", "4"]  # fmt: skip
    got = run_ranks(_compiled_zero3, 2, zero3, timeout=300)[0]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]),
                               torch.tensor([r["loss"] for r in eager]), rtol=1e-4, atol=1e-5)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# --init-from: read once per rank, and its shape without --model
# ---------------------------------------------------------------------------------------------
def test_init_from_is_read_once_and_gives_the_shape_without_model(gpt2_data, snapshot,  # noqa: F811
                                                                  tmp_path, monkeypatch):  # fmt: skip
    """test_finetune's GPT-2-layout snapshot (the tiny preset's width, 2 blocks) without
    --model: train.py takes the preset of its width (tiny) and trains from it, reading the
    file once (validate checks it, build_chunks copies it). Before: --model's default, small,
    was refused ("has n_layer=2 ...: not --model small's"), and with --model the checkpoint
    was read twice per rank."""
    reads = []
    real = train.model_lib.GPT.load_pretrained

    def spy(path, *args, **kwargs):
        reads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(train.model_lib.GPT, "load_pretrained", spy)
    flags = [f for f in FINETUNE_FLAGS if f not in ("--model", "tiny")]
    assert "--model" not in flags
    train.main(flags + ["--init-from", snapshot, "--data-dir", gpt2_data, "--out-dir",
                        str(tmp_path)])  # fmt: skip
    assert len(reads) == 1, reads
    meta = checkpoint.complete_checkpoints(tmp_path)[0] / "meta.json"
    assert json.loads(meta.read_text())["config"]["model"] == "tiny"
    assert metrics(tmp_path)[0]["step"] == 0
