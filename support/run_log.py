"""What train.py writes as it runs: metrics.jsonl's rows, a printed line each, loss.png.

A train row: step, loss (the logged step's own mean loss, not a mean since the last
row), lr, grad_norm (and comm_bytes with dp > 1; with fp16, skipped: whether the loss
scaler skipped the step, and a skipped step always gets a row),
tokens seen, tokens/s (all ranks and per rank), MFU and HFU (support/gpus.py), peak
memory (the GPU's allocator, or the CPU's peak RSS) and the ETA. A val row: step,
val_loss, tokens. The model's FLOPs per token come from train.py, which knows the model.
"""

import json
import resource
import time
from pathlib import Path

import torch

from support import gpus
from support.distributed import print0
from support.files import atomic_write


def lora_flops_per_token(flops: int, n_params: int, config, lora_rank: int) -> int:
    """MFU's FLOPs per token with LoRA (02's apply_lora: four linears a block).

    From the model's `flops` (6N + attention) less the frozen weights' own gradients,
    2N of the non-embedding `n_params` (the backward still computes their inputs'),
    plus 6 per factor number: 16·r·C of them a block (`config`: n_embd, n_layer).
    """
    factors = 16 * lora_rank * config.n_embd * config.n_layer
    return flops - 2 * n_params + 6 * factors


class Logger:
    """Rank 0 prints a line per logged step and appends its fields to metrics.jsonl.

    `flops_per_token` is MFU's count (the model's); `hfu_flops_per_token` adds what
    recomputation redoes. `dtype_name` ("fp32", "bf16", "fp16") picks the GPU's peak.
    `grid` tells this rank (`.rank`) and the number of ranks (`.world`).
    """

    def __init__(
        self,
        out_dir,
        start_step: int,
        tokens_per_step: int,
        max_steps: int,
        flops_per_token: int,
        hfu_flops_per_token: int,
        dtype_name: str,
        grid,
        device: torch.device,
    ):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tokens_per_step = tokens_per_step
        self.max_steps = max_steps
        self.flops = flops_per_token
        self.hw_flops = hfu_flops_per_token
        self.rank = grid.rank
        self.world = grid.world
        self.device = device
        self.t_start = time.perf_counter()
        self.t_last = self.t_start
        self.step_start = start_step
        self.step_last = start_step - 1
        cuda = device.type == "cuda"
        gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
        self.peak = gpus.peak_flops(gpu, dtype_name)
        if self.rank == 0:
            self.keep_rows_before(start_step)

    def keep_rows_before(self, start_step: int) -> None:
        """On resume, drop the rows logged after the checkpoint, and any torn line.

        A kill mid-write tears a row: a prefix, maybe NULs, and a whole row after it on
        the same line. The file is rewritten atomically, so a kill now loses no row.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = ""
        if self.path.is_file():
            text = self.path.read_text(errors="replace")
        kept = ""
        for line in text.splitlines():
            try:
                if json.loads(line)["step"] < start_step:
                    kept += line + "\n"
            except (ValueError, KeyError, TypeError):  # Not a whole row: a torn write.
                print(f"{self.path}: skipping a torn line {line[:60]!r}")
        atomic_write(self.path, lambda tmp: tmp.write_text(kept))

    def write(self, row: dict) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def peak_memory(self) -> int:
        """Bytes: the GPU's peak allocation, or on the CPU the peak RSS (Linux: KiB)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def train_row(self, step: int, stats: dict) -> None:
        """Log a train step: `stats` holds loss, lr, grad_norm (and comm_bytes; with
        fp16, skipped), the loss and the norm as device tensors, read here (a sync)."""
        stats = {k: v.item() if torch.is_tensor(v) else v for k, v in stats.items()}
        now = time.perf_counter()
        steps = step - self.step_last
        tok_s = self.tokens_per_step * steps / (now - self.t_last)
        self.t_last = now
        self.step_last = step
        util = gpus.mfu(tok_s, self.flops, self.world, self.peak)
        hw = gpus.mfu(tok_s, self.hw_flops, self.world, self.peak)
        mem = self.peak_memory()
        per_step = (now - self.t_start) / (step + 1 - self.step_start)
        eta = per_step * (self.max_steps - step - 1)
        tokens = (step + 1) * self.tokens_per_step
        row = {"kind": "train", "step": step, **stats, "tokens": tokens}
        row.update(tokens_per_s=tok_s, tokens_per_s_per_gpu=tok_s / self.world)
        row.update(mfu=util, hfu=hw, peak_mem_gb=mem / 1e9, eta_s=eta)
        self.write(row)
        mfu_text = "n/a" if util is None else f"{100 * util:.1f}%"
        if hw != util:  # Full recomputation's extra forward.
            mfu_text += f" (hfu {100 * hw:.1f}%)"
        rate = f"{tok_s:,.0f} tok/s ({tok_s / self.world:,.0f}/rank) | mfu {mfu_text}"
        if "comm_bytes" in stats:  # dp > 1: the gradient bytes this rank sent.
            rate += f" | comm {stats['comm_bytes'] / 1e6:.2f} MB"
        losses = f"loss {stats['loss']:.4f} | lr {stats['lr']:.2e}"
        losses += f" | norm {stats['grad_norm']:.3f}"
        rest = f"mem {mem / 1e9:.2f} GB | eta {eta / 60:.1f} min"
        print0(f"step {step:5d} | {losses} | {rate} | {rest}")

    def val_row(self, step: int, val_loss: float) -> None:
        tokens = (step + 1) * self.tokens_per_step
        self.write(
            {"kind": "val", "step": step, "val_loss": val_loss, "tokens": tokens}
        )
        print0(f"step {step:5d} | val loss {val_loss:.4f}")


def plot_losses(out_dir) -> Path:
    """The run's one figure, loss.png: train and validation loss against tokens seen."""
    # No pyplot: no GUI backend, and no global figure to close.
    from matplotlib.figure import Figure

    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    ax = Figure(figsize=(7, 4)).subplots()
    for kind, key, style in (("train", "loss", "-"), ("val", "val_loss", "o-")):
        points = [(r["tokens"], r[key]) for r in rows if r["kind"] == kind]
        if points:
            ax.plot(*zip(*points), style, label=f"{kind} loss")
    ax.set(xlabel="tokens seen", ylabel="cross-entropy (nats)", title="training run")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(out_dir) / "loss.png"
    ax.figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def open_log(run, start: int, flops: int, n_params: int, dtype_name: str) -> Logger:
    """A train.Run's Logger from step `start` on. `flops`: 02's FLOPs per token (6N +
    attention); with LoRA, less the frozen weights' gradients (`n_params`: 02's N, the
    non-embedding parameters); HFU adds what --recompute redoes (support/gpus.py)."""
    cfg = run.cfg
    if cfg.lora_rank:  # No gradients of the frozen weights; the factors' instead.
        flops = lora_flops_per_token(flops, n_params, run.gpt_config, cfg.lora_rank)
    hfu = flops + gpus.recompute_flops_per_token(run.gpt_config, run.T, cfg.recompute)
    tokens = cfg.batch_size * run.T  # Per step.
    args = (tokens, cfg.max_steps, flops, hfu, dtype_name, run.grid, run.device)
    return Logger(cfg.out_dir, start, *args)
