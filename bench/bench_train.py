"""Benchmark train.py: tokens/s of each parallel layout at 8 ranks on this machine.

    python bench/bench_train.py                 # 8 ranks, the CPU main job's model (small)
    python bench/bench_train.py --ranks 4 --steps 10

Each layout trains the same model on the same global batch with torchrun; tokens/s is the median
over the logged steps after the first (which includes warm-up). Every layout also reports its
loss at the last step: they must agree (the tests prove it to 1e-4; here it is a sanity check).
On a 2-core CPU, 8 ranks time-share the cores, so the numbers compare the layouts' overheads
(communication, pipeline bubble), not a speed-up: that needs one GPU per rank.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root
from bench import timing  # noqa: E402

# The layouts timed at each rank count, by name ("dp2 tp2": --dp 2 --tp 2); dp x tp x pp
# is the rank count.
LAYOUTS = {
    8: ["dp8", "dp4 tp2", "dp2 tp4", "dp4 pp2", "dp2 pp4", "dp2 tp2 pp2", "tp4 pp2"],
    4: ["dp4", "dp2 tp2", "tp4", "pp4", "dp2 pp2", "tp2 pp2"],
    2: ["dp2", "tp2", "pp2"],
}


def flags(layout: str) -> list[str]:
    """train.py's flags for a layout's name: "dp2 tp2" -> --dp 2 --tp 2."""
    out = []
    for part in layout.split():
        out += [f"--{part[:2]}", part[2:]]
    return out


def run(layout: str, ranks: int, steps: int, data_dir: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={ranks}", "train.py", *flags(layout)]
        cmd += ["--data-dir", data_dir, "--out-dir", out, "--max-steps", str(steps)]
        cmd += ["--log-interval", "1", "--eval-interval", "0", "--eval-steps", "1"]
        cmd += ["--sample-tokens", "0", "--micro-batch-size", "4", "--batch-size", "32"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, env=env)
        done, seconds = timing.timed(run, cmd, text=True)
        if done.returncode:
            return {"error": done.stderr.strip().splitlines()[-1]}
        rows = [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["kind"] == "train"]
        return {
            "tok_s": statistics.median(r["tokens_per_s"] for r in train[1:] or train),
            "loss": train[-1]["loss"],
            "seconds": seconds,
        }


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--ranks", type=int, default=8, choices=sorted(LAYOUTS), help="torchrun processes"
    )
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per layout")
    parser.add_argument("--data-dir", default="data/stdlib-bpe4096", help="prepared by 01_data.py")
    parser.add_argument("--layouts", default="", help="comma-separated names ('': all)")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",") if args.layouts else LAYOUTS[args.ranks]
    what = "small GPT, global batch 32 x 128 tokens, micro-batch 4, fp32"
    print(timing.machine(f"{args.ranks} ranks of 1 thread", what))
    print(f"{'layout':14s} {'tokens/s':>9s} {'per rank':>9s} {'last loss':>10s} {'wall':>6s}")
    failed = []
    for name in layouts:
        r = run(name, args.ranks, args.steps, args.data_dir)
        if "error" in r:
            print(f"{name:14s} failed: {r['error']}")
            failed.append(name)
            continue
        row = f"{name:14s} {r['tok_s']:9,.0f} {r['tok_s'] / args.ranks:9,.0f}"
        print(f"{row} {r['loss']:10.4f} {r['seconds']:5.0f}s", flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
