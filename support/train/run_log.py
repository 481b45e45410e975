"""What train.py writes as it runs: metrics.jsonl's rows, a printed line each, loss.png.

A train row: step, loss (the logged step's own mean loss, not a mean since the last
row), lr, grad_norm (and comm_bytes with dp > 1; with fp16, skipped: whether the loss
scaler skipped the step, and a skipped step always gets a row),
tokens seen, tokens/s (all ranks and per rank; the time of the steps alone, without
evaluation and checkpoints: Logger.paused), MFU and HFU (support/gpus.py), peak memory
(the GPU's allocator, or the CPU's peak RSS; the MAX over all ranks, the fullest rank, as
09 predicts it) and the ETA (wall time per step so far, evaluations and saves included);
beside them 09's prediction of this run, predicted_tokens_per_s and predicted_peak_mem_gb
(its fullest rank), so every run checks the planner. A val row: step, val_loss, tokens. The model's
FLOPs per token come from train.py, which knows the model; 09's plan_run comes from it
too, as does --plan's (plan_text).
"""

import contextlib
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from support import gpus
from support.distributed import print0
from support.files import atomic_write
from support.gpus import GPUS, plannable
from support.plan import plan_report
from support.plan.shape import shape_text
from support.train.config import ConfigError

GIB = 2**30


def gpu_key(device: torch.device | None = None) -> str:
    """support/gpus' key of `device` (None: this machine's; "cpu" on a CPU), or the
    GPU's own name when 09 cannot plan for it (a card the table lacks, or has only the
    peaks of): gpus.match, the one name matcher, as MFU's peak_flops."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    key = gpus.match(name)
    return key if key in plannable() else name


def plan_of(plan_run, cfg, gpt_config, gpu: str, gpus_per_node: int):
    """09's `plan_run` of the settings `cfg` on `gpu`, or a ConfigError: an unknown GPU,
    or a layout 09 refuses."""
    try:
        return plan_run(cfg, gpt_config, gpu, gpus_per_node)
    except ValueError as e:  # 09's PlanError, get_gpu's unknown GPU.
        raise ConfigError(f"09_plan.py on {gpu}: {e}") from None


def plan_text(plan, cfg, gpt_config) -> str:
    """train.py --plan's report of 09's `plan` of the settings `cfg` (the model
    `gpt_config`): the model's shape, the layout's memory and time (09's two lines),
    whether it fits, and --max-steps' hours."""
    spec = GPUS[plan.gpu]
    n = plan.n_gpus
    T = plan.tokens_per_step // cfg.batch_size
    head = f"{cfg.model} on {n} x {plan.gpu}, batch {cfg.batch_size} x {T}"
    lines = [f"09_plan.py's plan of this run: {head}, {plan.ranks[0]['dtype']}"]
    lines.append(f"model: {shape_text(gpt_config)}")
    lines += plan_report.describe(plan)
    share = f"{plan.capacity / GIB:.1f} GiB (90% of {spec.memory / GIB:.1f})"
    over = (plan.memory["total"] - plan.capacity) / GIB
    lines.append(f"fits in {share}" if plan.fits else f"{over:.1f} GiB over {share}")
    tokens = cfg.max_steps * plan.tokens_per_step
    cost = plan.budget(tokens)
    hours = cost["hours"]
    took = f"{60 * hours:.1f} min" if hours < 1 else f"{hours:.2f} h"
    took += f", {cost['gpu_hours']:.3g} GPU-hours"
    lines.append(f"{cfg.max_steps:,} steps, {tokens:,} tokens: {took}")
    if cost["kwh"] is not None:
        lines[-1] += f", {cost['kwh']:.3g} kWh at {spec.watts:.0f} W (TDP)"
    return "\n".join(lines)


class Logger:
    """Rank 0 prints a line per logged step and appends its fields to metrics.jsonl.

    `flops_per_token` is MFU's count (the model's); `hfu_flops_per_token` adds what
    recomputation redoes. `dtype_name` ("fp32", "bf16", "fp16") picks the GPU's peak.
    `grid` tells this rank (`.rank`) and the number of ranks (`.world`). `plan` is
    09's Plan of this run (logged beside the measured), or why there is none (a str).
    Time spent inside `paused()` (evaluation, checkpoints) is left out of tokens/s and
    MFU: they measure the training steps. The ETA keeps it (wall time per step so far):
    evaluations and saves recur, and a job's time limit must cover them.
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
        plan=None,
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
        self.paused_since_row = 0.0  # Seconds paused since the last train row.
        self.step_start = start_step
        self.step_last = start_step - 1
        cuda = device.type == "cuda"
        gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
        self.peak = gpus.peak_flops(gpu, dtype_name)
        self.plan = None if isinstance(plan, str) else plan
        if self.rank == 0:
            self.keep_rows_before(start_step)
        if self.plan is not None:  # The run's first log lines: what 09 expects.
            mem = f"{self.plan.memory['total'] / 1e9:.2f} GB"
            tok_s = f"{self.plan.tokens_per_s:,.0f} tok/s"
            what = f"peak memory {mem} (its fullest rank), {tok_s}"
            if not cuda:  # The log's mem is then the process's whole RSS.
                what += "; the log's mem on a CPU is the whole process, torch included"
            print0(f"predicted by 09_plan.py ({self.plan.gpu}): {what}")
        elif plan is not None:
            print0(f"predicted by 09_plan.py: nothing ({plan})")

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

    @contextlib.contextmanager
    def paused(self):
        """The time inside is left out of tokens/s and MFU (evaluation, saves).

        On a GPU the steps' queued kernels are drained first (a sync, here only): they
        are the steps' time, which evaluation's .item() would otherwise wait out."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        began = time.perf_counter()
        try:
            yield
        finally:
            self.paused_since_row += time.perf_counter() - began

    def peak_memory(self) -> int:
        """Bytes: the GPU's peak allocation, or on the CPU the peak RSS (Linux: KiB)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def fullest_rank_memory(self) -> int:
        """peak_memory's MAX over all ranks: one all-reduce of one number."""
        mem = self.peak_memory()
        if self.world == 1:
            return mem
        t = torch.tensor(mem, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def train_row(self, step: int, stats: dict) -> None:
        """Log a train step: `stats` holds loss, lr, grad_norm (and comm_bytes; with
        fp16, skipped), the loss and the norm as device tensors, read here (a sync).

        Called on every rank at the same steps (a collective: the peak memory's MAX).
        train.py's condition is alike on all ranks: the step, and fp16's skipped flag,
        whose inf check 06's scaler all-reduces over the world."""
        stats = {k: v.item() if torch.is_tensor(v) else v for k, v in stats.items()}
        now = time.perf_counter()
        steps = step - self.step_last
        took = now - self.t_last - self.paused_since_row  # The steps' own time.
        tok_s = self.tokens_per_step * steps / took
        self.t_last = now
        self.step_last = step
        self.paused_since_row = 0.0
        util = gpus.mfu(tok_s, self.flops, self.world, self.peak)
        hw = gpus.mfu(tok_s, self.hw_flops, self.world, self.peak)
        mem = self.fullest_rank_memory()
        # The ETA keeps the pauses: evaluations and saves recur, spread over the steps.
        per_step = (now - self.t_start) / (step + 1 - self.step_start)
        eta = per_step * (self.max_steps - step - 1)
        tokens = (step + 1) * self.tokens_per_step
        row = {"kind": "train", "step": step, **stats, "tokens": tokens}
        row.update(tokens_per_s=tok_s, tokens_per_s_per_gpu=tok_s / self.world)
        row.update(mfu=util, hfu=hw, peak_mem_gb=mem / 1e9, eta_s=eta)
        if self.plan is not None:  # 09's numbers, beside the measured two above.
            row["predicted_tokens_per_s"] = self.plan.tokens_per_s
            row["predicted_peak_mem_gb"] = self.plan.memory["total"] / 1e9
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


def open_log(run, start, flops, dtype_name, plan_run=None, redo=0) -> Logger:
    """A train.Run's Logger from step `start` on. `flops`: 02's FLOPs per token (6N +
    attention; with LoRA, its count); HFU adds `redo`, what --recompute redoes (02's).
    `plan_run` is 09's: rank 0 plans the run on this GPU, with the ranks of a node; a
    plan that fails, however, is printed as one line and the run goes on without it."""
    cfg = run.cfg
    plan = None
    if plan_run is not None and run.grid.rank == 0:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", run.grid.world))
        try:  # Advisory: a failure is said in one line, and the run goes on.
            plan = plan_of(plan_run, cfg, run.gpt_config, gpu_key(run.device), per_node)
        except ConfigError as e:  # A layout or GPU 09 refuses.
            plan = str(e)
        except Exception as e:  # 09 failed (a KeyError, a ZeroDivisionError, ...).
            why = " ".join(f"{type(e).__name__}: {e}".split())  # One line.
            plan = f"failed: {why}"
    hfu = flops + redo
    tokens = cfg.batch_size * run.T  # Per step.
    args = (tokens, cfg.max_steps, flops, hfu, dtype_name, run.grid, run.device, plan)
    return Logger(cfg.out_dir, start, *args)
