"""bench/bench_pipeline.py: the pipeline bubble as measured, next to (p-1)/(v·m+p-1).

For each pipeline size p (default 4, then 2) one world of p gloo CPU ranks is spawned.
In it, every schedule (gpipe, 1f1b, interleaved with v=2) runs at m = 4, 8, 16
microbatches: one warm-up step, then --steps timed ones. Each step's timeline is what
05b_schedules.pipeline_step recorded (real start and end of every forward and backward on
every rank); its bubble is 05's bubble_fraction: 1 - (mean busy time per rank) / (first
start to last end). Anything that is not a forward or backward counts as bubble: waiting
for a message, the message itself, Python between actions, and, when ranks outnumber
free cores, time the OS gave to another rank. The median over the timed steps is printed
with the formula and the ratio of the two.

To see how far the machine is from "one core per stage", each rank's forward + backward
of one microbatch is also timed alone (the others parked in a barrier). "slowdown" is
the busy time per rank in the pipelined step over m times that: about 1 when ranks run
truly in parallel, about p / cores when p ranks share fewer cores, which stretches every
action and distorts the bubble.

Target: within 10% of the formula for GPipe and 1F1B, and the
interleaved bubble smaller by about v.

--naive adds 05's two plain loops as the first rows, the naive GPipe (`gpipe_naive`) and
the explicit 1F1B (`one_f_one_b`): with it, the demo's table (`python 05b_schedules.py`, one
step after a warm-up) comes out as medians over --steps steps:
    python bench/bench_pipeline.py --naive --p 4 --m 8 --n-embd 256 --b 4 --steps 3

Besides the table: the simulator's ideal timelines (05b's `simulate`, t_f = t_b = 1) as
text, and for every (p, m) a Gantt PNG and a Chrome trace (open it in ui.perfetto.dev)
of the median step, under --out-dir (support/pipeline/gantt.py draws both).

Run:  python bench/bench_pipeline.py                 (about 8 minutes on 2 CPU cores)
      python bench/bench_pipeline.py --p 4 --m 8 --figure docs/pipeline_p4_m8.png
          (the README's measured figure; `python 05b_schedules.py --plot` draws the simulated)
"""

import argparse
import importlib
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# The repo root: the numbered files, and tests/distributed.py's run_ranks.
sys.path.insert(0, str(ROOT))
from bench import timing  # noqa: E402

pp = importlib.import_module("05_pipeline")  # the stages, the loops, the bubble
sched = importlib.import_module("05b_schedules")  # the tables and their executor
model_lib = importlib.import_module("02_model")
from support.pipeline.gantt import plot_timelines, write_chrome_trace  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402


def config(args):
    # 8 blocks: two per stage at p=4, one per chunk when interleaved with v=2. C = 512
    # and b·T = 512 tokens make one block's forward about 0.1 s of matmuls on one core,
    # so the fixed cost of each action (a 1 MB message over loopback, waking the rank,
    # Python) is a few percent of it; at C = 256 the interleaved schedule's 2x more
    # actions visibly eat its gain.
    return model_lib.GPTConfig(
        n_layer=8, n_head=4, n_embd=args.n_embd, block_size=args.T, vocab_size=256
    )


def ascii_timeline(timeline, unit: float = 1.0, chunks: bool = False) -> str:
    """One row per rank, one column per `unit` of time: Fi/Bi (+ the chunk's letter);
    a dot is idle. (How 05's and 05b's docstring pictures were drawn.)"""
    w = 3 if chunks else 2
    lines = []
    for r, events in enumerate(timeline):
        row = f"r{r} "
        t = 0.0
        for e in events:
            row += ".".rjust(w) * round((e.start - t) / unit)
            label = f"{e.op}{e.mb}" + ("abcdefgh"[e.chunk] if chunks else "")
            row = row + label.ljust(w * round((e.end - e.start) / unit))
            t = e.end
        lines.append(row.rstrip())
    return "\n".join(lines)


def forward_backward(chunks, ids, args, C):
    """One microbatch through this rank's chunks (a random input past the first)."""
    for c in chunks:
        x = ids if c.is_first else torch.randn(args.b, args.T, C, requires_grad=True)
        c(x).float().pow(2).mean().backward()


def isolated_cost(chunks, rank, p, args, reps=3):
    """Seconds for one microbatch's forward + backward through this rank's chunks,
    measured with the other ranks parked in a barrier (one rank at a time): the cost
    with a core to itself."""
    C = chunks[0].config.n_embd
    best = float("inf")
    ((ids, _),) = model_lib.byte_batches(args.T, args.b)  # (b, T)
    for turn in range(p):
        torch.distributed.barrier()
        for _ in range(reps if turn == rank else 0):
            _, seconds = timing.timed(forward_backward, chunks, ids, args, C)
            best = min(best, seconds)
    torch.distributed.barrier()
    return best


NAIVE = "gpipe, naive"  # 05's gpipe_naive: GPipe's order, one blocking call per message
LOOP = "1f1b, loop"  # 05's one_f_one_b: 1F1B's order, Megatron's paired p2p calls


def runs(args):
    """What is timed: 05b's schedules, after its two plain loops with --naive."""
    # zb1 needs 05c's B/W split of the stages: 05c's own demo measures it.
    plain = tuple(s for s in sched.SCHEDULES if s != "zb1")
    return ((NAIVE, LOOP) if args.naive else ()) + plain


def rank_main(rank, p, args):
    """Every (schedule, m) on this world: {(schedule, m): [events of each timed step]},
    and {schedule: isolated forward + backward seconds of one microbatch on this
    rank}."""
    torch.manual_seed(0)
    model = model_lib.GPT(config(args))
    embed_group = pp.embedding_group([list(range(p))])
    out = {}
    for schedule in runs(args):
        v = 2 if schedule == "interleaved" else 1
        chunks = pp.split_model(model, rank, p, v)
        out[schedule] = isolated_cost(chunks, rank, p, args)
        for m in args.m:
            (batch,) = model_lib.byte_batches(args.T, args.b * m, seed=m)  # (B, T) each
            steps = []
            for _ in range(args.steps + 1):  # the first is a warm-up
                model.zero_grad(set_to_none=True)
                if schedule == NAIVE:
                    res = pp.gpipe_naive(chunks[0], batch, m, embed_group=embed_group)
                elif schedule == LOOP:
                    res = pp.one_f_one_b(chunks[0], batch, m, embed_group=embed_group)
                else:
                    res = sched.pipeline_step(
                        chunks, batch, m, schedule, embed_group=embed_group
                    )
                steps.append(res.events)
            out[(schedule, m)] = steps[1:]
    return out


def measure(p, args):
    load0 = os.getloadavg()[0]
    # subtle: the ranks fork from tests/distributed.py's zygote, which finds rank_main
    # by its module's name, so this file's importable name, not __main__.
    job = importlib.import_module("bench.bench_pipeline").rank_main
    per_rank, wall = timing.timed(run_ranks, job, p, args, timeout=1800)
    load1 = os.getloadavg()[0]
    rows = []
    timelines = {}
    for schedule in runs(args):
        v = 2 if schedule == "interleaved" else 1
        alone = statistics.mean(
            r[schedule] for r in per_rank
        )  # F+B of one microbatch, per rank
        for m in args.m:
            steps = [[r[(schedule, m)][i] for r in per_rank] for i in range(args.steps)]
            bubbles = [pp.bubble_fraction(tl) for tl in steps]
            i = bubbles.index(
                statistics.median_low(bubbles)
            )  # the median step, shown as is
            tl = steps[i]
            span = max(e.end for ev in tl for e in ev) - min(
                e.start for ev in tl for e in ev
            )
            busy = sum(e.end - e.start for ev in tl for e in ev) / p  # per rank
            ideal = (
                m * alone / (1 - sched.bubble_formula(p, m, v))
            )  # a core per rank, free messages
            timelines[(schedule, m)] = (tl, bubbles[i])
            rows.append((schedule, v, m, span, ideal, busy / (m * alone), bubbles[i]))
    return rows, timelines, (load0, load1, wall)


def report(p, rows, load):
    before = f"load average {load[0]:.1f} before, {load[1]:.1f} after"
    print(f"\np = {p} ranks ({before}; {load[2]:.0f} s)")
    head = (
        f"{'schedule':<13}{'v':>2}{'m':>4}{'step ms':>9}{'ideal ms':>9}{'slowdown':>9}"
    )
    print(f"{head}{'bubble':>8}{'formula':>9}{'ratio':>7}")
    for schedule, v, m, span, ideal, slow, bubble in rows:
        f = sched.bubble_formula(p, m, v)
        row = f"{schedule:<13}{v:>2}{m:>4}{span * 1e3:>9.0f}{ideal * 1e3:>9.0f}"
        print(f"{row}{slow:>9.2f}{bubble:>8.1%}{f:>9.1%}{bubble / f:>7.2f}")
    print(
        "formula: (p-1)/(v·m+p-1). ideal: the step with a core per rank, from the isolated F+B"
    )
    print(
        "cost and the formula. slowdown: busy time per rank / (m x its isolated F+B); 1 = none."
    )


def print_ideal(p, m):
    """The simulator's timelines for this p and m: what the measured ones should look
    like."""
    for schedule in (s for s in sched.SCHEDULES if s != "zb1"):
        v = 2 if schedule == "interleaved" else 1
        _, timeline = sched.simulate(schedule, p, m, v, 1.0, 1.0)
        print(
            f"\nsimulated {schedule} p={p} m={m} v={v} (t_f = t_b = 1; a column is 1/v): "
            f"bubble {pp.bubble_fraction(timeline):.1%} = {sched.bubble_formula(p, m, v):.1%}"
        )
        print(ascii_timeline(timeline, 1.0 / v, chunks=v > 1))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--p", type=int, nargs="+", default=[4, 2], help="pipeline sizes to run"
    )
    parser.add_argument(
        "--m",
        type=int,
        nargs="+",
        default=[4, 8, 16],
        help="microbatch counts: bubble shrinks",
    )
    parser.add_argument(
        "--steps", type=int, default=2, help="timed steps (after one warm-up)"
    )
    parser.add_argument("--b", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--T", type=int, default=64, help="sequence length")
    parser.add_argument(
        "--n-embd",
        type=int,
        default=512,
        help="model width C: matmuls outweigh per-action costs",
    )
    parser.add_argument(
        "--naive", action="store_true", help="also time 05's two plain loops"
    )
    parser.add_argument(
        "--figure", default="", help="also write the p=4, m=8 Gantt PNG here"
    )
    parser.add_argument(
        "--out-dir", default="out/bench_pipeline", help="Gantt PNGs, traces"
    )
    args = parser.parse_args(argv)
    if any(m % p for p in args.p for m in args.m):
        parser.error("interleaved needs every --m divisible by every --p")
    cores = os.cpu_count()
    print(timing.machine("gloo over loopback, 1 thread per rank"))
    for p in args.p:
        print_ideal(p, min(args.m))
        rows, timelines, load = measure(p, args)
        report(p, rows, load)
        if p > cores:
            print(f"note: {p} ranks on {cores} cores: ranks time-share the CPU")
        for m in args.m:
            named = {}
            for s in runs(args):
                timeline, bubble = timelines[(s, m)]
                f = sched.bubble_formula(p, m, 2 if s == "interleaved" else 1)
                where = f"measured on {cores} CPU cores"
                named[f"{s}: {where}, bubble {bubble:.1%} (formula {f:.1%})"] = timeline
            path = Path(args.out_dir) / f"pipeline_p{p}_m{m}"
            plot_timelines(named, path.with_suffix(".png"))
            write_chrome_trace(named, path.with_suffix(".json"))
            if args.figure and (p, m) == (4, 8):
                plot_timelines(named, args.figure)
                print(f"wrote {args.figure}")
    print(f"\nGantt charts and Chrome traces in {args.out_dir}/")


if __name__ == "__main__":
    main()
