"""Fine-tuning from GPT-2's weights: train.py --init-from.

The checkpoint is written here, in Hugging Face's GPT-2 layout (Conv1D weights, 50,257 rows, a
snapshot folder with config.json), with random weights: no network. The data is tokenized with
GPT-2's tokenizer (skipped, with the reason, where its files cannot be loaded).
"""

import copy
import importlib
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

train = importlib.import_module("train")
to_hf_state_dict = importlib.import_module("support.train.export").to_hf_state_dict
data = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")

# the tiny preset's shape (2 blocks, 2 heads, C = 32) with GPT-2's vocabulary and biases, and a
# longer context than the runs' 32 positions (train.py keeps wpe's first 32 rows)
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50257)
FLAGS = ["--model", "tiny", "--tokenizer", "gpt2", "--batch-size", "8", "--micro-batch-size", "2",
         "--max-steps", "1", "--log-interval", "1", "--eval-interval", "0", "--eval-steps", "1",
         "--ckpt-interval", "0", "--sample-tokens", "0", "--dtype", "fp32"]  # fmt: skip


@pytest.fixture(scope="module")
def gpt2_data(gpt2_encoding, tmp_path_factory):
    """Python-like text in GPT-2's ids, windows of 32."""
    root = tmp_path_factory.mktemp("finetune-data")
    (root / "src").mkdir()
    for d in range(20):
        text = "".join(f"def f{d}_{i}(x):\n    return x * {i} + {d}\n" for i in range(80))
        (root / "src" / f"doc{d}.py").write_text(text)
    data.prepare(str(root / "src"), "gpt2", root / "data", block_size=32)
    return str(root / "data")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A GPT-2-layout snapshot folder: pytorch_model.bin and config.json. Every tensor is moved
    off its init (biases off 0, LayerNorm gains off 1), so no weight can pass by being left at
    train.py's own init."""
    folder = tmp_path_factory.mktemp("gpt2-snapshot")
    torch.manual_seed(7)
    model = model_lib.GPT(model_lib.GPTConfig(**SHAPE))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.save(to_hf_state_dict(model), folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({"n_head": SHAPE["n_head"]}))
    return str(folder)


def direct_loss(checkpoint, data_dir) -> float:
    """The same weights loaded directly (02, unpadded: 50,257 columns), on train.py's step-0
    batch: the global batch of 8, as one process's loader sees it."""
    model = model_lib.GPT.load_pretrained(checkpoint)
    x, y = data.DataLoader(data_dir, "train", 8, 32, seed=1337).get_batch(0)
    with torch.no_grad():
        return model(x, y)[1].item()


def step0_loss(rank, world, data_dir, checkpoint, out_dir, layout):
    train.main(FLAGS + layout + ["--init-from", checkpoint, "--data-dir", data_dir,
                                 "--out-dir", out_dir])  # fmt: skip
    dist.barrier()
    return json.loads(open(f"{out_dir}/metrics.jsonl").readline())["loss"] if rank == 0 else None


def test_init_from_gives_the_checkpoints_loss_at_1_process_and_dp2_tp2_pp2(
    gpt2_data, checkpoint, tmp_path
):
    """Step 0's loss (before any update) is the checkpoint's own loss on that batch: at one
    process and at dp 2 x tp 2 x pp 2, where the padded vocabulary (50,304 rows, split over TP),
    the pipeline's cut and DP's halves of the batch all take part. fp32, sums in other orders:
    1e-5 relative. Catches a weight left at its init (the loss of a random model differs by
    ~1e-2 here), a transposed Conv1D weight, and padding columns counted in the loss."""
    want = direct_loss(checkpoint, gpt2_data)
    train.main(FLAGS + ["--init-from", checkpoint, "--data-dir", gpt2_data,
                        "--out-dir", str(tmp_path / "one")])  # fmt: skip
    one = json.loads((tmp_path / "one" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    layout = ["--dp", "2", "--tp", "2", "--pp", "2"]
    eight = run_ranks(step0_loss, 8, gpt2_data, checkpoint, str(tmp_path / "8"), layout,
                      timeout=300)[0]  # fmt: skip
    torch.testing.assert_close(torch.tensor([one, eight]), torch.tensor([want, want]), rtol=1e-5,
                               atol=0)  # fmt: skip
    torch.manual_seed(1337)  # the model train.py would train without --init-from
    fresh = model_lib.GPT(model_lib.GPTConfig(**SHAPE))
    x, y = data.DataLoader(gpt2_data, "train", 8, 32, seed=1337).get_batch(0)
    assert abs(fresh(x, y)[1].item() - want) > 1e-3, "the checkpoint is indistinguishable"


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--tokenizer", "char"], "--init-from needs data of --tokenizer gpt2"),
        (["--model", "small"], "has n_layer=2, n_head=2, n_embd=32: not --model"),
        (["--init-from", "/nonexistent/gpt2"], "--init-from /nonexistent/gpt2: [Errno 2] No such"),
        (["--init-from", "GARBAGE"], "garbage.bin: "),  # not a pickle: one line too
    ],
)
def test_init_from_bad_input_is_one_line(gpt2_data, checkpoint, tmp_path, extra, expected, capsys):
    flags = FLAGS + ["--init-from", checkpoint, "--data-dir", gpt2_data, "--out-dir", str(tmp_path)]
    if extra[0] == "--tokenizer":  # the same kind of text, in characters
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "a.py").write_text("def f(x):\n    return x + 1\n" * 300)
        data.prepare(str(tmp_path / "src"), "char", tmp_path / "char", block_size=32)
        flags += ["--data-dir", str(tmp_path / "char")]
    if "GARBAGE" in extra:
        (tmp_path / "garbage.bin").write_bytes(b"\x00 not a checkpoint")
        extra = ["--init-from", str(tmp_path / "garbage.bin")]
    with pytest.raises(SystemExit) as e:
        train.main(flags + extra)
    message = str(e.value)
    assert message.startswith("train.py: error: ") and expected in message, message
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------
# LoRA (02's apply_lora; train.py --lora-rank)
# ---------------------------------------------------------------------------------------------
def lora_pair(rank=4, alpha=8.0, seed=0):
    """A base GPT (biases, 2 blocks) and its LoRA copy, built from one seed."""
    torch.manual_seed(seed)
    base = model_lib.GPT(model_lib.GPTConfig.from_preset("tiny"))
    return base, model_lib.apply_lora(copy.deepcopy(base), rank, alpha)


def test_lora_starts_as_the_base_model_and_trains_only_its_factors():
    """B = 0 at the start: the same logits, to the bit. Only A and B require gradients; after a
    backward the frozen weights have none; B's gradient is not zero (A's is, through B = 0)."""
    base, lora = lora_pair()
    idx = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(lora(idx)[0], base(idx)[0], rtol=0, atol=0)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable), trainable
    lora(idx, idx)[1].backward()
    for name, p in lora.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    assert all(p.grad.abs().sum() > 0 for n, p in lora.named_parameters() if n.endswith("lora_B"))


def test_lora_counts_and_merge():
    """Per wrapped linear r·(in + out) trainable numbers (Hu et al.'s count), AdamW's state
    2·r·(in + out) of them in fp32, beside the full model's; the merged weights W + (alpha/r)·B·A
    give the LoRA model's logits (fp32, one matmul instead of two: 1e-5)."""
    r, alpha = 4, 8.0
    base, lora = lora_pair(r, alpha)
    C, L = base.config.n_embd, base.config.n_layer
    # c_attn C -> 3C, attn.c_proj C -> C, c_fc C -> 4C, mlp.c_proj 4C -> C: r·16C per block
    formula = L * r * ((C + 3 * C) + (C + C) + (C + 4 * C) + (4 * C + C))
    trained = [p for p in lora.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trained) == formula == L * 16 * r * C
    optimizer = torch.optim.AdamW(trained)
    with torch.no_grad():  # B off zero, so that the merge has something to fold
        for name, p in lora.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.05)
    idx = torch.randint(0, 256, (2, 32))
    lora(idx, idx)[1].backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert sum(t.numel() for t in state) == 2 * formula  # m and v; the full model: 2N
    merged = model_lib.GPT(base.config)
    merged.load_state_dict(model_lib.merge_lora(lora.state_dict(), alpha / r), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(merged(idx)[0], lora(idx)[0], rtol=1e-5, atol=1e-5)
        assert (merged(idx)[0] - base(idx)[0]).abs().max() > 1e-3  # the update is really in


LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--max-steps", "3", "--lr", "1e-2",
        "--warmup-steps", "1", "--eval-interval", "0", "--eval-steps", "2"]  # fmt: skip


def lora_runs(rank, world, data_dir, checkpoint, tmp, layouts):
    out = []
    for name, layout in layouts:
        train.main(FLAGS + LORA + layout + ["--init-from", checkpoint, "--data-dir", data_dir,
                                            "--out-dir", f"{tmp}/{name}"])  # fmt: skip
        dist.barrier()
        out.append(open(f"{tmp}/{name}/metrics.jsonl").read() if rank == 0 else None)
    return out


def rows(text, kind="train"):
    return [r for r in map(json.loads, text.splitlines()) if r["kind"] == kind]


def test_lora_fine_tuning_is_one_process_at_dp2_tp2_zero1_pp2_and_exports_merged(
    gpt2_data, checkpoint, tmp_path
):
    """LoRA from the checkpoint, 3 steps: dp 2 x tp 2, dp 4 with ZeRO-1 and dp 2 x pp 2 (the tied
    embedding frozen on both stages) give one process's losses and gradient norms (fp32, sums in other orders: 1e-4 relative, as tests/test_train.py
    argues); at dp 2 DataParallel sends only the factors' gradients (this TP rank's share);
    the exported model.pt is a plain GPT (the factors folded in) whose validation loss is the
    one the LoRA run logged, and whose weights moved off the checkpoint's."""
    flags = LORA + ["--init-from", checkpoint, "--data-dir", gpt2_data]
    train.main(FLAGS + flags + ["--out-dir", str(tmp_path / "one")])
    one = (tmp_path / "one" / "metrics.jsonl").read_text()
    layouts = [("dp2tp2", ["--dp", "2", "--tp", "2"]), ("zero1", ["--dp", "4", "--zero", "1"]),
               ("dp2pp2", ["--dp", "2", "--pp", "2"])]  # fmt: skip
    runs = run_ranks(lora_runs, 4, gpt2_data, checkpoint, str(tmp_path), layouts, timeout=300)[0]
    for (name, _), text in zip(layouts, runs):
        for key in ("loss", "grad_norm"):
            got, want = ([r[key] for r in rows(t)] for t in (text, one))
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key, n=name: f"{n}, {k}: {m}")  # fmt: skip
    C, L, r = SHAPE["n_embd"], SHAPE["n_layer"], 4
    # each tp rank's factors: column-parallel r·(in + out/2), row-parallel r·(in/2 + out)
    block = r * ((C + 3 * C // 2) + (C // 2 + C) + (C + 4 * C // 2) + (4 * C // 2 + C))
    sent = [row["comm_bytes"] for row in rows(runs[0])]
    assert sent == [4 * L * block] * 3, sent  # fp32 gradients of the factors only
    exported, blob = train.load_exported(tmp_path / "one" / "model.pt")
    assert not any("lora" in k for k in blob["model"]), "the factors were not folded in"
    val = data.DataLoader(gpt2_data, "val", 8, 32, seed=1337)
    with torch.no_grad():
        losses = [exported(*val.get_batch(i))[1] for i in range(2)]
    logged = rows(one, "val")[-1]["val_loss"]
    torch.testing.assert_close(torch.stack(losses).mean().item(), logged, rtol=1e-5, atol=0)
    for name, _ in layouts:  # the sharded runs' exports: TP's and PP's merges, then LoRA's
        other = train.load_exported(tmp_path / name / "model.pt")[1]["model"]
        for k, v in blob["model"].items():
            torch.testing.assert_close(other[k], v, rtol=1e-4, atol=1e-6, msg=f"{name}: {k}")
    base = model_lib.GPT.load_pretrained(checkpoint).state_dict()
    w = "transformer.h.0.mlp.c_fc.weight"
    assert (exported.state_dict()[w] - base[w]).abs().max() > 1e-4, "LoRA's update is missing"


def test_lora_flops_and_flag_errors(tmp_path):
    """MFU's FLOPs with LoRA, counted by hand for the small preset: the forward (2 per weight)
    and the inputs' gradients (2 more) for every frozen matmul weight, all 6 for the factors'
    16·r·C a block, attention's 12·L·C·T as without LoRA. And --grad-compression powersgd
    with --lora-rank is refused: a factor's own rank is r already; so is a --min-lr above --lr."""
    config = model_lib.GPTConfig.from_preset("small", vocab_size=50257)
    C, L, T, V, r = 128, 4, 128, 50257, 8
    weights = L * 12 * C * C + V * C  # the blocks' matrices and the tied head (biases: ~0)
    biases = L * 13 * C + C * 2  # biases and gains, counted as 02 counts them: in N
    attention = 12 * L * C * T
    want = 4 * (weights + biases) + 6 * 16 * r * C * L + attention
    flops = model_lib.flops_per_token(config, T)  # What train.py's log counts without LoRA.
    assert model_lib.flops_per_token(config, T, lora_rank=r) == want
    assert flops == 6 * (weights + biases) + attention
    # train.py's log is told that count (02's), not the full model's: a run, its parts only.
    cfg = train.TrainConfig(lora_rank=r, out_dir=str(tmp_path))
    grid = SimpleNamespace(rank=0, world=1)
    cpu = torch.device("cpu")
    run = SimpleNamespace(cfg=cfg, gpt_config=config, T=T, dtype=torch.float32, grid=grid, device=cpu)
    log = train.open_log(run, 0)
    assert (log.flops, log.hw_flops) == (want, want), (log.flops, want)
    cfg = train.TrainConfig(dp=2, grad_compression="powersgd", lora_rank=4)
    with pytest.raises(train.ConfigError, match="powersgd with --lora-rank"):
        train.check_flags(cfg, world_size=2)
    # a fine-tuning LR below the default --min-lr: the cosine "decay" would climb 5x; refused
    with pytest.raises(train.ConfigError, match="--min-lr 0.0003 exceeds --lr 6e-05"):
        train.check_flags(train.TrainConfig(lr=6e-5), world_size=1)
    train.check_flags(train.TrainConfig(lr=6e-5, lr_schedule="constant"), world_size=1)
