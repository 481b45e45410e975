"""train.py's four learning-rate schedules (--lr-schedule), drawn and trained together.

    python bench/bench_schedules.py                   # the main job once per schedule (~4 min each)
    python bench/bench_schedules.py --steps 100 --figure /tmp/s.png

Each run is the main job's recipe (`python train.py`: the small GPT, 4,096-token BPE,
500 steps of 32 x 128 tokens, lr 3e-3 to 3e-4, 50 warm-up steps) with only --lr-schedule
changed, so the runs see the same batches from the same initial weights. The figure has
the learning rate against the step (left, from train.lr_at itself) and the validation
loss of each run (right)."""

import argparse
import importlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import timing  # noqa: E402
from support.train.command_line import parse_args  # noqa: E402

train = importlib.import_module("train")


def run(schedule: str, steps: int, out: Path, extra=()) -> dict:
    """Train the main job with this schedule (or read a finished run in `out`): its
    validation losses by step and its wall time (None when read)."""
    metrics = out / "metrics.jsonl"
    seconds = None
    rows = []
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if not any(r["kind"] == "val" and r["step"] == steps - 1 for r in rows):
        shutil.rmtree(out, ignore_errors=True)  # an unfinished run: trained again
        argv = ["--lr-schedule", schedule, "--max-steps", str(steps), "--out-dir", str(out)]
        argv += ["--sample-tokens", "0", "--ckpt-interval", "0", *extra]
        _, seconds = timing.timed(train.main, argv)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {
        "val": {r["step"]: r["val_loss"] for r in rows if r["kind"] == "val"},
        "seconds": seconds,
    }


def draw(results: dict, steps: int, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    lr_ax, val_ax = fig.subplots(1, 2)
    for name in train.LR_SCHEDULES:
        cfg, _ = parse_args(["--lr-schedule", name, "--max-steps", str(steps)])
        lr_ax.plot([train.lr_at(cfg, s) for s in range(steps)], label=name)
        if (
            name in results
        ):  # from the first evaluation after step 0 (8.3 for all: ln V)
            val_ax.plot(
                *zip(*sorted(results[name]["val"].items())[1:]), "o-", label=name
            )
    lr_ax.set(
        xlabel="step", ylabel="learning rate", title="--lr-schedule (main job's flags)"
    )
    val_ax.set(
        xlabel="step", ylabel="validation loss (nats)", title="the main job, trained"
    )
    for ax in (lr_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", type=int, default=500, help="--max-steps of every run"
    )
    parser.add_argument(
        "--out", default="out/schedules", help="a run folder per schedule here"
    )
    parser.add_argument(
        "--figure", default="docs/lr_schedules.png", help="where the figure goes"
    )
    parser.add_argument(
        "--no-train", action="store_true", help="only draw the schedules"
    )
    parser.add_argument("--data-dir", default="", help="train.py's ('': the main job's)")
    parser.add_argument("--model", default="", help="train.py's ('': the main job's)")
    args = parser.parse_args(argv)
    extra = ["--data-dir", args.data_dir] if args.data_dir else []
    extra += ["--model", args.model] if args.model else []
    results = {}
    for i, name in enumerate([] if args.no_train else train.LR_SCHEDULES):
        print(f"[{i + 1}/{len(train.LR_SCHEDULES)}] --lr-schedule {name}", flush=True)
        results[name] = run(name, args.steps, Path(args.out) / name, extra)
    draw(results, args.steps, Path(args.figure))
    print(f"\n{timing.machine()}; {args.steps} steps; wrote {args.figure}")
    print("| --lr-schedule | val loss at step 100 | val loss at the last step | time |")
    print("|---|---|---|---|")
    for name, r in results.items():
        last = max(r["val"])
        row = (
            f"| {name} | {r['val'].get(100, float('nan')):.3f} | {r['val'][last]:.3f} |"
        )
        took = (
            "read from --out"
            if r["seconds"] is None
            else f"{r['seconds'] / 60:.1f} min"
        )
        print(f"{row} {took} |")


if __name__ == "__main__":
    main()
