"""train.py resumes a PowerSGD run from a checkpoint taken in its warm-up (issue 30, item 1).

The issue's reproduction: dp 2, --grad-compression powersgd --powersgd-warmup-steps 5, stopped
after 3 steps (--steps-this-run 3: the checkpoint holds the hook's state before any sketch, with
no Q drawn), then --resume to --max-steps 8. It failed with "does not fit this run" (exit 1)
every time; it must resume and give the uninterrupted run's losses and gradient norms, bit for
bit (tests/test_train.py's exact resume covers a checkpoint taken after the warm-up)."""

from tests.distributed import run_ranks
from tests.test_train import _straight_and_resumed, data_dir  # noqa: F401 (the fixture)

# The flags; --max-steps 8 overrides _straight_and_resumed's 6 (argparse: the last wins).
EXTRA = ["--dp", "2", "--micro-batch-size", "2", "--grad-compression", "powersgd"]
EXTRA += ["--powersgd-warmup-steps", "5", "--max-steps", "8"]


def test_a_checkpoint_from_powersgds_warmup_resumes_bit_for_bit(data_dir, tmp_path):  # noqa: F811
    args = (data_dir, str(tmp_path), EXTRA)
    straight, split = run_ranks(_straight_and_resumed, 2, *args, timeout=400)[0]
    assert [r["step"] for r in split] == list(range(8)), (
        "the resumed run must reach step 7"
    )
    # ==, not close: the same arithmetic in the same order (gloo on CPU is deterministic).
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in split] == [r["grad_norm"] for r in straight]
