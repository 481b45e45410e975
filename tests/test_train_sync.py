"""train.py at full speed: a plain step (no log line, no evaluation, no checkpoint) makes no
host-device synchronisation from the project's own code, and the next batch is prefetched
without changing which batch a step reads. Also: fp16's skipped steps logged, the timeout,
what the log measures (tokens/s without evaluation and checkpoints, the fullest rank's peak
memory), a preemption during a mid-run evaluation, and the grid's names.

A sync is a call that makes the CPU wait for the GPU to drain: `.item()`, `.tolist()`,
`.numpy()`, `.cpu()`, `bool()`, `int()`, `float()` or formatting of a tensor. On a CPU none of
them waits for anything, so the test counts the calls themselves: every such Tensor method is
wrapped, and a call counts when the frame that made it is in one of the project's files (the
numbered lessons, train.py, support/), never when torch calls it from inside itself.
"""

import contextlib
import functools
import importlib
import math
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from support.train import checkpoint, run_log
from support.train.grid import Grid
from support.train.prefetch import Prefetcher
from tests.distributed import run_ranks
from tests.test_train import BASE, data_dir, metrics  # noqa: F401 (data_dir: the fixture)

train = importlib.import_module("train")
ROOT = Path(__file__).resolve().parents[1]
# Every Tensor method through which Python code reads a tensor's value on the host.
SYNCS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__format__",
    "__repr__",
)
STEPS = 8  # Steps 0 and 7 log a line; 1..6 are plain.
VOTE = 4  # --vote-interval: the preemption vote (.tolist()) after steps 0 and 4.


def ours(filename: str) -> bool:
    """A file of the project (not torch's, not a test's): a lesson, train.py, or any
    module under support/ (its packages too)."""
    path = Path(filename).resolve()
    mine = path.parent == ROOT or ROOT / "support" in path.parents
    return mine and path.suffix == ".py"


def test_ours_sees_every_file_of_the_project():
    """The counters below blame only `ours` files: one it missed (support/train/ once)
    would let a sync there pass unseen."""
    project = [ROOT / "train.py", *ROOT.glob("[0-9]*.py"), *(ROOT / "support").rglob("*.py")]
    assert all(ours(str(path)) for path in project)
    assert not ours(torch.__file__) and not ours(__file__)


@contextlib.contextmanager
def counting_syncs(log: list):
    """Append (method, file:line) to `log` for each call to a SYNCS method made from our files."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def wrap(name, real):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1)
            if ours(caller.f_code.co_filename):
                log.append(f"{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return real(self, *args, **kwargs)

        return counted

    for name, real in originals.items():
        setattr(torch.Tensor, name, wrap(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)


def syncs_per_step(argv) -> list[list[str]]:
    """train.main(argv) with the syncs counted: the calls made from one train_step's start to
    the next one's (the step, then the loop's logging, evaluation, checkpoint and vote)."""
    log, starts = [], []
    real_step = train.train_step

    def marked(run, step):
        starts.append(len(log))
        return real_step(run, step)

    train.train_step = marked
    try:
        with counting_syncs(log):
            train.main(argv)
    finally:
        train.train_step = real_step
    ends = starts[1:] + [len(log)]
    return [log[a:b] for a, b in zip(starts, ends)]


def check_plain_steps(per_step, world: int, name: str) -> None:
    """Steps 1..6 are plain: no sync, except the vote's one .tolist() after step 4 when
    world > 1 (the first vote comes after step 0, then every VOTE steps: each step here
    takes far less than checkpoint.VOTE_SECONDS / VOTE)."""
    assert len(per_step) == STEPS, name
    for step in range(1, STEPS - 1):
        allowed = 1 if world > 1 and step % VOTE == 0 else 0
        calls = per_step[step]
        assert len(calls) <= allowed, f"{name}, step {step}: {len(calls)} syncs: {calls}"


def flags(data, out_dir, extra):
    quiet = ["--log-interval", "100", "--max-steps", str(STEPS), "--vote-interval", str(VOTE)]
    return BASE + ["--data-dir", data, "--out-dir", out_dir] + quiet + extra


def test_a_plain_step_makes_no_sync_on_one_process(data_dir, tmp_path):  # noqa: F811
    """4 accumulated microbatches of 2. Before: 06's global_token_count read the token count
    (.item() twice), accumulate_gradients each microbatch's loss (.item() x 4), train_step the
    loss and the gradient norm: 8 syncs a step. A world of one votes without a collective."""
    per_step = syncs_per_step(flags(data_dir, str(tmp_path), ["--micro-batch-size", "2"]))
    check_plain_steps(per_step, 1, "1 process, 4 microbatches")
    assert per_step[0], "step 0 logs a line: it reads the loss (the counting works)"


LAYOUTS = [
    ("dp2", ["--dp", "2", "--micro-batch-size", "2"]),
    ("tp2", ["--tp", "2", "--micro-batch-size", "4"]),
    ("pp2", ["--pp", "2", "--micro-batch-size", "2"]),
    ("cp2", ["--cp", "2", "--micro-batch-size", "2"]),
    ("dp2-zero3", ["--dp", "2", "--zero", "3", "--micro-batch-size", "2"]),
]


def _two_ranks(rank, world, data, tmp):
    """Each layout's syncs per step, with every grid train.main built kept, and a peak
    memory of 1 GB on rank 0 and 2 GB on rank 1; then a preemption in an evaluation."""
    grids = []
    real_grid = train.build_grid
    real_peak = run_log.Logger.peak_memory

    def kept_grid(*args):
        grids.append(real_grid(*args))
        return grids[-1]

    train.build_grid = kept_grid
    run_log.Logger.peak_memory = lambda self: (1 + self.rank) * 10**9
    checkpoint.VOTE_SECONDS = 1e9  # Every VOTE steps, however slow a step on a loaded CPU.
    out = []
    try:
        for name, extra in LAYOUTS:
            out.append(syncs_per_step(flags(data, f"{tmp}/{name}", extra)))
            dist.barrier()
    finally:
        train.build_grid = real_grid
        run_log.Logger.peak_memory = real_peak
        checkpoint.VOTE_SECONDS = 10.0
    cp = grids[[name for name, _ in LAYOUTS].index("cp2")]
    one_group = cp.dp_cp_group is cp.cp_group and dist.get_world_size(cp.cp_group) == 2
    peaks = [[r["peak_mem_gb"] for r in metrics(f"{tmp}/{name}")] for name, _ in LAYOUTS]

    def signal_rank_1(stop):  # SIGTERM to rank 1 alone, as a node's kill would.
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return stop

    extra = ["--dp", "2", "--micro-batch-size", "2", "--vote-interval", "100"]
    preempted = preempted_in_evaluation(data, f"{tmp}/preempt", extra, signal_rank_1)
    return out, one_group, peaks, preempted


def vote_gaps(rank, world):
    """checkpoint.Preemption under a clock the test moves. "mixed": rank 0's steps take
    4 s, rank 1's 0.1 s, --vote-interval 10; "capped": both ranks' take 0.1 s,
    --vote-interval 3. Returns, per case and vote, (the step, what at() said, the next
    vote's step)."""
    clock = [0.0]
    real_clock = checkpoint.time
    checkpoint.time = SimpleNamespace(perf_counter=lambda: clock[0])
    cases = {"mixed": (4.0 if rank == 0 else 0.1, 10), "capped": (0.1, 3)}
    try:
        out = {}
        for case, (step_s, max_gap) in cases.items():
            votes = checkpoint.Preemption(world, torch.device("cpu"), max_gap=max_gap)
            votes.start_at(5)  # a resume at step 5
            said = []
            for step in range(5, 12):
                clock[0] += step_s
                if rank == 1 and step == 9:
                    votes.signals.append(signal.SIGTERM)  # (the handler's effect)
                before = votes.next_vote
                stop = votes.at(step)
                if votes.next_vote != before:  # a vote: what it said, when the next comes
                    said.append((step, stop, votes.next_vote))
            out[case] = said
        return out
    finally:
        checkpoint.time = real_clock


@functools.cache
def vote_results() -> list:
    return run_ranks(vote_gaps, 2, timeout=60)


def test_a_plain_step_makes_no_sync_at_dp2_tp2_pp2_cp2_zero3(data_dir, tmp_path):  # noqa: F811
    """The same at dp 2, tp 2, pp 2, cp 2 and dp 2 with ZeRO-3, on every rank. Before, the
    preemption vote (an all-reduce and .item()) ran after every step; now once every
    --vote-interval steps. In the same world: at dp 1, cp 2 the DP x CP group is cp_group
    itself (it was a second communicator over the same ranks); metrics.jsonl's peak memory
    is the fullest rank's (rank 1's 2 GB here; it was rank 0's own 1 GB); a SIGTERM to rank
    1 during step 2's evaluation saves at step 2 on both ranks and resumes bit for bit."""
    results = run_ranks(_two_ranks, 2, data_dir, str(tmp_path), timeout=420)
    for rank, (per_layout, one_group, peaks, _) in enumerate(results):
        assert one_group, f"rank {rank}: dp 1, cp 2 made a second group for DP x CP"
        for (name, _), per_step, peak in zip(LAYOUTS, per_layout, peaks):
            check_plain_steps(per_step, 2, f"{name}, rank {rank}")
            if rank == 0:
                assert any(per_step[STEPS - 1]), f"{name}: the last step logs (reads the loss)"
            assert peak == [2.0, 2.0], f"{name}: the rows at steps 0 and 7 hold the max"
    check_preempted_in_evaluation(*results[0][3])


def test_the_ranks_agree_on_each_vote_and_on_when_the_next_one_comes():
    """vote_gaps on 2 ranks: rank 0's steps take 4 s, so it asks for a vote every
    10 s // 4 = 2 steps; rank 1's take 0.1 s (10 s would be 100 steps; --vote-interval caps
    it at 10). Both must vote after the resumed run's first step (5), then every 2 (the
    smaller: MIN), and both say True at the first vote after rank 1's signal (9): MAX.
    Votes at rank 1's pace (10 steps) would leave a signal to rank 0 waiting 40 s; ranks
    that each kept their own gap would meet different collectives and hang."""
    results = [per_rank["mixed"] for per_rank in vote_results()]
    want = [(5, False, 7), (7, False, 9), (9, True, 11), (11, True, 13)]
    assert results == [want, want]


def test_votes_come_at_least_every_vote_interval_steps():
    """Both ranks at 0.1 s a step would vote every 10 s / 0.1 s = 100 steps; --vote-interval
    3 caps the gap: votes at 5, 8 and 11, and rank 1's signal at step 9 stops both at 11.
    Without the cap the first vote's next would be step 105, and the signal would wait."""
    results = [per_rank["capped"] for per_rank in vote_results()]
    want = [(5, False, 8), (8, False, 11), (11, True, 14)]
    assert results == [want, want], "the gap to the next vote is not --vote-interval"


# ---------------------------------------------------------------------------------------------
# A preemption during a mid-run evaluation saves at that step and exits
# ---------------------------------------------------------------------------------------------
def preempted_in_evaluation(data, tmp, extra, at_step_2):
    """5 steps straight (evaluating at steps 0, 2 and 4); then the same run, with step 2's
    evaluation given the stop `at_step_2(stop)` returns, then resumed to the end. Returns
    (straight train rows, val rows; resumed ones; the checkpoints and rows at the stop)."""
    common = BASE + ["--data-dir", data, "--max-steps", "5", "--eval-interval", "2"]
    common += extra
    train.main(common + ["--out-dir", f"{tmp}/straight"])
    real = train.evaluate
    calls = []

    def evaluate(run, stop):
        calls.append(stop)
        return real(run, at_step_2(stop) if len(calls) == 2 else stop)

    train.evaluate = evaluate
    try:
        train.main(common + ["--out-dir", f"{tmp}/stopped"])
    finally:
        train.evaluate = real
    if dist.is_initialized():
        dist.barrier()  # Rank 0 has written every row.
    ckpts = [c.name for c in checkpoint.complete_checkpoints(f"{tmp}/stopped")]
    at_stop = (ckpts, metrics(f"{tmp}/stopped"), metrics(f"{tmp}/stopped", "val"))
    train.main(common + ["--out-dir", f"{tmp}/stopped", "--resume"])
    if dist.is_initialized():
        dist.barrier()
    straight = (metrics(f"{tmp}/straight"), metrics(f"{tmp}/straight", "val"))
    resumed = (metrics(f"{tmp}/stopped"), metrics(f"{tmp}/stopped", "val"))
    return straight, resumed, at_stop


def check_preempted_in_evaluation(straight, resumed, at_stop):
    """Saved at step 2 and stopped there (before: trained on to the next vote, or the end),
    no val row for the half-done evaluation, and the resumed run equal to the straight one
    bit for bit (==): train rows, and the val rows but step 2's."""
    ckpts, rows, val = at_stop
    assert ckpts == ["step_0000002"], ckpts
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["step"] for r in val] == [0]
    keys = ("step", "loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in resumed[0]] == [
        [r[k] for k in keys] for r in straight[0]
    ]
    want = [(r["step"], r["val_loss"]) for r in straight[1] if r["step"] != 2]
    assert [(r["step"], r["val_loss"]) for r in resumed[1]] == want
    assert [r["step"] for r in straight[1]] == [0, 2, 4]  # Step 4, the last: once.


def test_a_stop_in_a_mid_run_evaluation_saves_there_and_resumes(data_dir, tmp_path, capsys):  # noqa: F811
    """One process: step 2's evaluation is stopped (its stop() says True: a signal while
    evaluating), and the later votes say False. Before, evaluate's None was only skipped:
    the run trained on to step 4 and saved there."""
    got = preempted_in_evaluation(data_dir, str(tmp_path), [], lambda stop: lambda: True)
    assert "preemption signal: saving at step 2 and exiting" in capsys.readouterr().out
    check_preempted_in_evaluation(*got)


# ---------------------------------------------------------------------------------------------
# tokens/s and the ETA measure the training steps alone
# ---------------------------------------------------------------------------------------------
def test_tokens_per_s_leaves_out_evaluation_and_checkpoints(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """A fake clock that moves only when a step (1 s), an evaluation (50 s) or a checkpoint
    (30 s) runs. Every row then reads 8 x 32 tokens a second, exactly (sums of whole seconds
    are exact in floats). Before, the row after an evaluation and a checkpoint read 2 steps
    in 82 s. The ETA keeps the pauses (they recur): wall seconds per step so far times the
    steps left. Row 0 at 1 s: 1 x 5; row 2 at 1 + 50 (eval 0) + 1 + 30 (save 1) + 1 = 83 s:
    83 / 3 x 3; row 4 at 83 + 50 (eval 2) + 1 + 30 (save 3) + 1 = 165 s: 165 / 5 x 1."""
    now = [0.0]
    monkeypatch.setattr(run_log, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def taking(seconds, fn):
        def timed(*args, **kwargs):
            now[0] += seconds
            return fn(*args, **kwargs)

        return timed

    monkeypatch.setattr(train, "train_step", taking(1.0, train.train_step))
    monkeypatch.setattr(train, "evaluate", taking(50.0, train.evaluate))
    save = train.checkpoint.save_checkpoint  # train.py calls it through the module
    monkeypatch.setattr(train.checkpoint, "save_checkpoint", taking(30.0, save))
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "6"]
    train.main(argv + ["--log-interval", "2", "--eval-interval", "2", "--ckpt-interval", "2"])
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 2, 4, 5]
    assert [r["tokens_per_s"] for r in rows] == [256.0] * 4, rows
    assert [r["eta_s"] for r in rows] == pytest.approx([5.0, 83.0, 33.0, 0.0]), rows
    assert now[0] == 6 * 1 + 4 * 50 + 3 * 30  # Evaluated at 0, 2, 4 and the end.


def test_a_pause_on_a_gpu_drains_the_steps_kernels_before_it_reads_the_clock(monkeypatch):
    """No step is synced on a GPU, so its kernels may still be queued when an evaluation
    starts: paused() synchronises first, and only then reads the clock, so their time counts
    as the steps'. (No GPU here: a "cuda" device with torch.cuda's calls recorded.)"""
    events = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    clock = SimpleNamespace(perf_counter=lambda: events.append("clock") or 0.0)
    monkeypatch.setattr(run_log, "time", clock)
    log = run_log.Logger("unused", 0, 256, 4, 1, 1, "bf16", Grid(rank=1), torch.device("cuda"))
    events.clear()
    with log.paused():
        events.append("evaluate")
    assert events == ["sync", "clock", "evaluate", "clock"]


# ---------------------------------------------------------------------------------------------
# The grid's names (the ones every file uses)
# ---------------------------------------------------------------------------------------------
def test_the_grid_answers_to_design_s_names():
    """The sizes by the grid's common names, and which stage a rank holds."""
    grid = Grid(rank=5, world=8, dp=2, tp=2, pp=2, pp_rank=1, dp_rank=0, tp_rank=1)
    sizes = (grid.world_size, grid.dp_size, grid.tp_size, grid.pp_size, grid.cp_size)
    assert sizes == (8, 2, 2, 2, 1)
    assert (grid.pp_is_first, grid.pp_is_last) == (False, True)
    first = Grid(world=4, pp=4, pp_rank=0)
    assert (first.pp_is_first, first.pp_is_last) == (True, False)
    middle = Grid(world=4, pp=4, pp_rank=2)
    assert (middle.pp_is_first, middle.pp_is_last) == (False, False)
    assert Grid().pp_is_first and Grid().pp_is_last  # One stage: both.


# ---------------------------------------------------------------------------------------------
# The next batch, prefetched
# ---------------------------------------------------------------------------------------------
def test_the_prefetched_batch_is_the_one_read_on_demand_across_a_resume(data_dir):  # noqa: F811
    """support/train/prefetch reads step s+1's batch on a thread while step s computes. A step's
    batch must stay the loader's pure function of (seed, step, dp rank): over 6 steps of an
    epoch boundary (9 steps an epoch here, at 4 of 8 rows and dp rank 1 of 2), and after a
    "resume" (a new Prefetcher started at step 12, as train() is after a checkpoint), every
    batch equals DataLoader.get_batch's, read afresh. Catches a prefetcher one step ahead or
    behind (it hands out step s+1's batch), or one that keeps the batch a resume should skip."""
    loader = train.data_lib.DataLoader(data_dir, "train", 4, 32, seed=3, dp_rank=1, dp_size=2)
    fresh = train.data_lib.DataLoader(data_dir, "train", 4, 32, seed=3, dp_rank=1, dp_size=2)
    steps = loader.steps_per_epoch
    for start, count in ((steps - 3, 6), (steps + 3, 3)):
        batches = Prefetcher(loader, "cpu")
        for step in range(start, start + count):
            x, y = batches.get_batch(step)
            want_x, want_y = fresh.get_batch(step)
            assert torch.equal(x, want_x) and torch.equal(y, want_y), f"step {step}"
        assert list(batches.ahead) == [start + count], "the next step's batch is on its way"
        assert batches.position(start) == fresh.position(start)
        batches.close()


# ---------------------------------------------------------------------------------------------
# A skipped fp16 step is recorded; the process group's timeout is a flag
# ---------------------------------------------------------------------------------------------
def test_a_step_the_fp16_scaler_skips_is_logged_as_skipped(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """The loss scale starts at 2^120, so every fp16 gradient overflows: the scaler skips and
    halves the scale each step (2^116 after 4 steps: still far too large). With a log line only
    every 100 steps, steps 1 and 2 are logged anyway, each with "skipped": true (and a gradient
    norm that is not finite). Before, metrics.jsonl had no such field, and a
    skipped step between two log lines left no trace."""
    make_scaler = train.mp_lib.make_scaler
    monkeypatch.setattr(train.mp_lib, "make_scaler",
                        lambda dtype: make_scaler(dtype, init_scale=2.0**120))  # fmt: skip
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--dtype", "fp16",
                   "--log-interval", "100", "--micro-batch-size", "4"]  # fmt: skip
    train.main(argv)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["skipped"] is True for r in rows), rows
    assert not any(math.isfinite(r["grad_norm"]) for r in rows), "the gradients overflowed"


def test_timeout_minutes_reaches_the_process_group(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """--timeout-minutes 0.5 gives init_distributed 30 s (it was a fixed 5 minutes: rank 0 can
    write a checkpoint's metadata alone behind a barrier for longer, on slow storage)."""
    seen = []
    real = train.distributed.init_distributed

    def spy(timeout_s=300.0):
        seen.append(timeout_s)
        return real(timeout_s)

    monkeypatch.setattr(train.distributed, "init_distributed", spy)
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "1"]
    train.main(argv + ["--timeout-minutes", "0.5"])
    assert seen == [30.0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_keep_checkpoints_keeps_the_newest_k(tmp_path):
    """--keep-checkpoints 2 over five saves leaves steps 4 and 3: the newest two, whole
    (each with its shard and meta.json). Keeping one too many, or the oldest, fails."""
    for step in range(5):
        shard = {"step": torch.tensor(step)}
        meta = lambda: {"note": "test"}  # noqa: E731 - meta.json's contents, on rank 0
        checkpoint.save(tmp_path, step, 0, 1, torch.device("cpu"), shard, meta, keep=2)
    kept = checkpoint.complete_checkpoints(tmp_path)
    assert [c.name for c in kept] == ["step_0000004", "step_0000003"], kept
    for folder in kept:
        assert (folder / checkpoint.shard_name(0)).is_file() and (folder / "meta.json").is_file()
