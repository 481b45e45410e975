"""Gradient compression (03, train.py --grad-compression): what it costs and when it pays.

    python bench/bench_compression.py                      # [1] 14 trainings (~60 min), [2]
    python bench/bench_compression.py --parts codec        # [2] only: codec times, ~1 min

[1] Quality: the main job's recipe (`python train.py`: the small GPT, 4,096-token BPE, 32 x 128
tokens a step) for --steps steps, at 2 and 4 DP ranks (torchrun, gloo), once per method: none,
fp16, bf16, PowerSGD rank 1, 4, 16 (10 exact steps first; rank 4 also with 50). Same data, same initial weights: the
validation loss at the end, and comm_bytes (train.py's count of what each rank all-reduced) of
the last step against the formula: 4Ψ, 2Ψ, 2Ψ, 4·(Σ(m+n)·r + Σ vectors). Finished runs are read
back from --out, not trained again.

[2] When it pays: a step sends the all-reduce's 2(N-1)/N · bytes per rank. Compression saves
    Δt_link = 2(N-1)/N · (bytes_none - bytes_method) / bandwidth
and costs its codec time t_codec (cast and copy back; PowerSGD's matmuls, QR and residuals),
measured here on this machine's CPU, one process, no communication. It makes the step faster
when bandwidth < 2(N-1)/N · (bytes saved) / t_codec: the break-even bandwidth. Step times at
10 and 100 Gb/s Ethernet and NVLink (450 GB/s a direction, H100) are computed from the
measured compute time with no overlap of communication and backward (DDP overlaps some, which
favours no compression). Compute and codec are this CPU's, so the link columns say what these
times would meet on each link, not what a GPU does (its compute and codec are far faster, which
moves the break-even up). For the main job's GPT and for GPT-2 124M's shapes.
"""

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import timing  # noqa: E402

model_lib = importlib.import_module("02_model")
ddp = importlib.import_module("03_ddp")
compression = importlib.import_module("03b_compression")

METHODS = {"none": []}
for half in ("fp16", "bf16"):
    METHODS[half] = ["--grad-compression", half]
for rank in (1, 4, 16):
    powersgd = ["--grad-compression", "powersgd", "--powersgd-rank", str(rank)]
    METHODS[f"powersgd r={rank}"] = powersgd
# torch's advice: exact steps no fewer than the LR's warm-up steps (the main job's: 50)
METHODS["powersgd r=4, 50 exact"] = METHODS["powersgd r=4"] + ["--powersgd-warmup-steps", "50"]
LINKS = {"10 Gb/s Ethernet": 10e9 / 8, "100 Gb/s Ethernet": 100e9 / 8, "NVLink (H100)": 450e9}


def train_run(method: str, dp: int, steps: int, out: Path) -> dict:
    """The main job at `dp` ranks with this method (or a finished run read back): the last
    validation loss, the last train row's comm_bytes, and the wall time (None when read)."""
    metrics = out / "metrics.jsonl"
    seconds = None
    if not metrics.is_file() or f'"step": {steps - 1}, "val_loss"' not in metrics.read_text():
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += [f"--nproc_per_node={dp}", "train.py", "--dp", str(dp)]
        argv += ["--max-steps", str(steps), "--out-dir", str(out), "--sample-tokens", "0"]
        argv += ["--ckpt-interval", "0", "--log-interval", "1", *METHODS[method]]
        subprocess.run(["rm", "-rf", str(out)], check=True)  # an unfinished run: trained again
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, os.cpu_count() // dp))}
        run = functools.partial(subprocess.run, cwd=ROOT, env=env, capture_output=True)
        done, seconds = timing.timed(run, argv, text=True)
        if done.returncode:
            raise SystemExit(
                f"{method} at dp {dp} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    val = [r["val_loss"] for r in rows if r["kind"] == "val"][-1]
    sent = [r["comm_bytes"] for r in rows if r["kind"] == "train"][-1]
    return {"val": val, "comm_bytes": sent, "seconds": seconds}


def hook_for(model, method: str):
    """03b's hook for a METHODS name (None: no compression; PowerSGD without warm-up)."""
    if method.startswith("powersgd"):
        r = int(method.split("=")[1].split(",")[0])
        return compression.PowerSGD(model.parameters(), r, 0)
    half = {"fp16": torch.half, "bf16": torch.bfloat16}.get(method)
    return None if half is None else compression.HalfPrecision(half)


def formula_bytes(model, method: str) -> int:
    """Bytes all-reduced per rank and step: 4Ψ (fp32), 2Ψ (fp16, bf16), PowerSGD rank r: 4·(Σ over
    m x n matrices of (m + n)·min(r, m, n) + Σ vectors): 03b's sent_formula."""
    return compression.sent_formula(list(model.parameters()), hook_for(model, method))[1]


def quality(args) -> None:
    config = model_lib.GPTConfig.from_preset("small", vocab_size=4096, pad_vocab_multiple=64)
    model = model_lib.GPT(config)
    print(f"\n[1] the main job's recipe, {args.steps} steps, validation loss at the end and")
    print(f"bytes all-reduced per rank in a step ({timing.machine()})")
    head = f"    {'method':<23}{'dp':>3} {'val loss':>9} {'comm_bytes':>12}"
    print(f"{head} {'formula':>12} {'1/x':>6} {'wall':>7}")
    for dp in args.dp:
        base = None
        for method in METHODS:
            res = train_run(
                method, dp, args.steps, Path(args.out) / f"dp{dp}-{method.replace(' ', '')}"
            )
            base = base or res["comm_bytes"]
            wall = "read" if res["seconds"] is None else f"{res['seconds']:.0f} s"
            row = f"    {method:<23}{dp:>3} {res['val']:9.3f} {res['comm_bytes']:12,}"
            row += f" {formula_bytes(model, method):12,} {base / res['comm_bytes']:6.1f}"
            print(f"{row} {wall:>7}", flush=True)


def codec_seconds(model, method: str, world: int, reps: int) -> float:
    """The median time of one step's compression and decompression of model's gradients (random,
    already in one bucket), without the communication: 03b's hook with an all-reduce that returns
    at once (fp16: cast, / N and copy back; PowerSGD: matmuls, QR and residuals)."""
    bucket = ddp.make_buckets(list(model.parameters()), None)[0]  # one bucket: every gradient
    for p, view in zip(bucket.params, bucket.views):
        view.copy_(torch.randn_like(p))
    instant = SimpleNamespace(world=world, all_reduce=lambda t: SimpleNamespace(wait=lambda: None))
    hook = hook_for(model, method)
    # One untimed call first: PowerSGD's draws Q and fills the residuals.
    return timing.median_seconds(lambda: hook(instant, bucket).wait(), reps, 1)


def compute_seconds(model, batch: int, T: int, reps: int = 5) -> float:
    """The median forward + backward time of one step on this machine (fp32)."""
    x = torch.randint(0, model.config.vocab_size, (batch, T))
    return timing.median_seconds(lambda: model(x, x)[1].backward(), reps, 1)


def when_it_pays(args) -> None:
    torch.manual_seed(0)
    small = model_lib.GPTConfig.from_preset("small", vocab_size=4096, pad_vocab_multiple=64)
    cases = [("main job's GPT", model_lib.GPT(small), 32 // 2, 128)]
    if not args.skip_gpt2:
        cases.append(("GPT-2 124M", model_lib.GPT(model_lib.GPTConfig.from_preset("gpt2")), 1, 128))
    N = 2
    for label, model, batch, T in cases:
        psi = sum(p.numel() for p in model.parameters())
        reps = min(args.reps, 3 if psi > 1e8 else 5)
        compute = compute_seconds(model, batch, T, reps)
        work = f"forward + backward of {batch} x {T} tokens a rank {1e3 * compute:.1f} ms"
        print(f"\n[2] {label} (Ψ = {psi:,}), N = {N} ranks: {work},")
        print(f"codec measured on {timing.machine()}")
        print(
            f"    {'method':<15} {'bytes':>12} {'codec':>9} {'break-even':>12}   "
            + "   ".join(f"step @ {k}" for k in LINKS)
        )
        none = formula_bytes(model, "none")
        for method in (m for m in METHODS if "exact" not in m):  # (the same codec as r=4)
            sent = formula_bytes(model, method)
            codec = 0.0 if method == "none" else codec_seconds(model, method, N, args.reps)
            saved = 2 * (N - 1) / N * (none - sent)
            even = "-" if method == "none" else f"{8 * saved / codec / 1e9:8.2f} Gb/s"
            steps = [compute + codec + 2 * (N - 1) / N * sent / bw for bw in LINKS.values()]
            cells = "   ".join(f"{1e3 * t:>{len(k) + 5}.1f} ms" for k, t in zip(LINKS, steps))
            print(f"    {method:<15} {sent:12,} {1e3 * codec:7.2f} ms {even:>12}   {cells}")
        print(
            "    break-even: the bandwidth below which the method makes the step faster "
            "(the codec's time < the link time it saves)"
        )


def main(argv=None) -> None:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=formatter)
    parser.add_argument("--parts", default="quality,codec", help="quality: [1]; codec: [2]")
    parser.add_argument("--steps", type=int, default=500, help="[1]: optimizer steps per run")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="[1]: DP sizes")
    parser.add_argument("--out", default="out/bench_compression", help="[1]: the runs' folders")
    parser.add_argument("--reps", type=int, default=7, help="[2]: timed codec calls; the median")
    parser.add_argument("--skip-gpt2", action="store_true", help="[2]: the main job's GPT only")
    args = parser.parse_args(argv)
    if "quality" in args.parts:
        quality(args)
    if "codec" in args.parts:
        when_it_pays(args)


if __name__ == "__main__":
    main()
