"""train.py's quiet steps: what a step that does not log leaves out, and what evaluation waits for.

A step's loss is each rank's share (the last stage's part of the pipeline's, each DP rank's
mean over its own tokens): adding the shares up takes an all-reduce over the PP group and one
over the DP x CP group, and only a logged row needs the sum. So a plain step runs neither;
before, every step ran both (train.py's train_step). And pipeline evaluation reads no count
on the host per batch: 05 counted each batch's real targets with int() (a sync on a GPU);
evaluate now hands 05b the count as a tensor and reads its total once, at the end.
"""

import importlib
from pathlib import Path

import torch.distributed as dist

from tests.distributed import run_ranks
from tests.test_train import BASE, data_dir  # noqa: F401 (data_dir: the fixture)
from tests.test_train_sync import counting_syncs

train = importlib.import_module("train")
STEPS = 4  # Rows at steps 0 and 3 (the last); 1 and 2 are plain.
EVAL_STEPS = 3  # Batches in the evaluation after the last step.
MICRO = ["--micro-batch-size", "2"]  # 2 microbatches a DP rank at dp 2, 4 at pp 2.
LAYOUTS = [("dp2", ["--dp", "2", *MICRO]), ("pp2", ["--pp", "2", *MICRO])]


def quiet_steps(data, out_dir, extra) -> dict:
    """train.main with, for each step, how many all-reduces took the very loss tensor
    train_step returned (in the step, or after it before the next one: the log's); and the
    syncs the final evaluation made, less the preemption vote's (support/train/checkpoint.py's,
    asked before each batch on purpose)."""
    real_all_reduce = dist.all_reduce
    real_step = train.train_step
    real_evaluate = train.evaluate
    reduced = []  # Every 0-dim tensor all-reduced, in order.
    starts = []
    losses = []
    evaluations = []

    def all_reduce(t, *args, **kwargs):
        if t.dim() == 0:
            reduced.append(t)
        return real_all_reduce(t, *args, **kwargs)

    def train_step(run, step):
        starts.append(len(reduced))
        stats = real_step(run, step)
        losses.append(stats["loss"])
        return stats

    def evaluate(run, stop):
        syncs = []
        with counting_syncs(syncs):
            val = real_evaluate(run, stop)
        evaluations.append([s for s in syncs if "checkpoint.py" not in s])
        return val

    dist.all_reduce = all_reduce
    train.train_step = train_step
    train.evaluate = evaluate
    try:
        argv = BASE + ["--data-dir", data, "--out-dir", out_dir, "--max-steps", str(STEPS)]
        train.main(argv + ["--log-interval", "100", "--eval-steps", str(EVAL_STEPS)] + extra)
    finally:
        dist.all_reduce = real_all_reduce
        train.train_step = real_step
        train.evaluate = real_evaluate
    ends = starts[1:] + [len(reduced)]
    per_step = []
    for a, b, loss in zip(starts, ends, losses):
        per_step.append(sum(t is loss for t in reduced[a:b]))
    return {"loss_all_reduces": per_step, "eval_syncs": evaluations}


def _layouts(rank, world, data, tmp):
    return {name: quiet_steps(data, str(Path(tmp) / name), extra) for name, extra in LAYOUTS}


def test_only_logged_steps_sum_the_loss_and_pipeline_evaluation_syncs_once(data_dir, tmp_path):  # noqa: F811
    """dp 2 and pp 2 on 2 ranks, 4 steps logged at 0 and 3: the loss train_step returned is
    all-reduced once at those steps (dp 2: over DP; pp 2: over PP; the other group is one
    rank) and never at steps 1 and 2; before, once at every step. The evaluation after the
    last step (3 batches) makes one sync, its total's .item() in train.py; before, pp 2 added
    05's int() of each batch's count: 4."""
    results = run_ranks(_layouts, 2, data_dir, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        for name, _ in LAYOUTS:
            r = res[name]
            where = f"{name}, rank {rank}"
            assert r["loss_all_reduces"] == [1, 0, 0, 1], f"{where}: {r}"
            assert len(r["eval_syncs"]) == 1, f"{where}: one evaluation, at the end"
            (syncs,) = r["eval_syncs"]
            assert len(syncs) == 1 and syncs[0].startswith("item at train.py"), f"{where}: {syncs}"
