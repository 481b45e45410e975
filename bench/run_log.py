"""What train.py writes while it runs: the rows of metrics.jsonl (and the line printed beside
each) and the run's figure, loss.png. Plumbing, kept out of train.py's lesson (DESIGN §2).

A train row: step, loss, lr, grad_norm, tokens seen, tokens/s (all ranks and per rank), MFU and
HFU (support/gpus.py), peak memory (the GPU's allocator, or the CPU's peak RSS) and the ETA.
"""

import importlib
import json
import resource
import time
from pathlib import Path

import torch

from support import distributed

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")
mp_lib = importlib.import_module("06_mixed_precision")
gpus = importlib.import_module("support.gpus")  # PEAK_FLOPS, peak_flops, mfu: MFU's denominator


def model_flops_per_token(gpt_config, T: int, lora_rank: int = 0) -> int:
    """MFU's FLOPs per token: 02's 6N + attention; with LoRA (02's apply_lora, four linears a
    block) less the frozen weights' own gradients, 2N (backward still computes their inputs'),
    plus 6 per factor number, 16·r·C of them a block."""
    flops = model_lib.flops_per_token(gpt_config, T)
    if lora_rank:
        N = model_lib.count_params(gpt_config, non_embedding=True)
        flops += 6 * 16 * lora_rank * gpt_config.n_embd * gpt_config.n_layer - 2 * N
    return flops


class Logger:
    """Rank 0 prints one line per --log-interval and appends the same fields to metrics.jsonl."""

    def __init__(self, run, start_step: int):  # run: train.Run
        self.run, self.path = run, Path(run.cfg.out_dir) / "metrics.jsonl"
        self.tokens_per_step = run.cfg.batch_size * run.T
        self.t_start = self.t_last = time.perf_counter()
        self.step_start, self.step_last = start_step, start_step - 1
        self.flops = model_flops_per_token(run.gpt_config, run.T, run.cfg.lora_rank)  # MFU's
        self.hw_flops = self.flops + gpus.recompute_flops_per_token(run.gpt_config, run.T)  # HFU's
        gpu = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu"
        self.peak = gpus.peak_flops(gpu, {v: k for k, v in mp_lib.DTYPES.items()}[run.dtype])
        if run.grid.rank == 0:  # on resume: drop rows logged after the checkpoint, and torn lines
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = self.path.read_text(errors="replace") if self.path.is_file() else ""
            kept = ""
            for line in text.splitlines():
                try:  # a kill mid-write tears a row: a prefix, maybe NULs and a whole row after it
                    kept += line + "\n" if json.loads(line)["step"] < start_step else ""
                except (ValueError, KeyError, TypeError):  # not a whole row: a torn write
                    print(f"{self.path}: skipping a torn line {line[:60]!r}")
            data_lib.atomic_write(self.path, lambda tmp: tmp.write_text(kept))  # a kill loses none

    def write(self, row: dict) -> None:
        if self.run.grid.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def train_row(self, step: int, stats: dict) -> None:
        now, world, cfg = time.perf_counter(), self.run.grid.world, self.run.cfg
        tok_s = self.tokens_per_step * (step - self.step_last) / (now - self.t_last)
        self.t_last, self.step_last = now, step
        util, hw = (gpus.mfu(tok_s, f, world, self.peak) for f in (self.flops, self.hw_flops))
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS (Linux: KiB)
        if self.run.device.type == "cuda":  # on a GPU: its peak allocation instead
            mem = torch.cuda.max_memory_allocated(self.run.device)
        eta = (now - self.t_start) / (step + 1 - self.step_start) * (cfg.max_steps - step - 1)
        row = {"kind": "train", "step": step, **stats, "tokens": (step + 1) * self.tokens_per_step}
        row.update(tokens_per_s=tok_s, tokens_per_s_per_gpu=tok_s / world, mfu=util, hfu=hw)
        self.write({**row, "peak_mem_gb": mem / 1e9, "eta_s": eta})
        mfu_text = "n/a" if util is None else f"{100 * util:.1f}%"
        mfu_text += f" (hfu {100 * hw:.1f}%)" if hw != util else ""  # full recomputation's
        rate = f"{tok_s:,.0f} tok/s ({tok_s / world:,.0f}/rank) | mfu {mfu_text}"
        if "comm_bytes" in stats:  # dp > 1: the gradient bytes this rank all-reduced this step
            rate += f" | comm {stats['comm_bytes'] / 1e6:.2f} MB"
        distributed.print0(f"step {step:5d} | loss {stats['loss']:.4f} | lr {stats['lr']:.2e} | "
                       f"norm {stats['grad_norm']:.3f} | {rate} | mem {mem / 1e9:.2f} GB | "
                       f"eta {eta / 60:.1f} min")  # fmt: skip

    def val_row(self, step: int, val_loss: float) -> None:
        tokens = (step + 1) * self.tokens_per_step
        self.write({"kind": "val", "step": step, "val_loss": val_loss, "tokens": tokens})
        distributed.print0(f"step {step:5d} | val loss {val_loss:.4f}")


def plot_losses(out_dir) -> Path:
    """The run's one figure, loss.png: train and validation loss against tokens seen."""
    from matplotlib.figure import (
        Figure,  # no pyplot: no GUI backend, no global figure to close
    )

    rows = [json.loads(r) for r in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    ax = Figure(figsize=(7, 4)).subplots()
    for kind, key, style in (("train", "loss", "-"), ("val", "val_loss", "o-")):
        if pts := [(r["tokens"], r[key]) for r in rows if r["kind"] == kind]:
            ax.plot(*zip(*pts), style, label=f"{kind} loss")
    ax.set(xlabel="tokens seen", ylabel="cross-entropy (nats)", title="training run")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.figure.savefig(path := Path(out_dir) / "loss.png", dpi=120, bbox_inches="tight")
    return path
