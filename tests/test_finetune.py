"""Fine-tuning from GPT-2's weights: train.py --init-from.

The checkpoint is written here, in Hugging Face's GPT-2 layout (Conv1D weights, 50,257 rows, a
snapshot folder with config.json), with random weights: no network. The data is tokenized with
GPT-2's tokenizer (skipped, with the reason, where its files cannot be loaded).
"""

import importlib
import json

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.test_model import to_hf_state_dict

train = importlib.import_module("train")
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
        (["--model", "small"], "has n_layer=2, n_head=2, n_embd=32, block_size=64: not --model"),
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
