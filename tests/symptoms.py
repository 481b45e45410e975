"""Failure messages in a reader's words, for the proofs the README's break-it exercises name.

`torch.testing.assert_close` says `Tensor-likes are not close!` and a few indices; a reader who
just deleted a division wants to hear "gradients are 2.0x one process's". `diagnose(actual,
expected)` names the usual shapes of a broken technique:

    k x the reference        a scale lost or doubled (a missing /N, a SUM for a mean)
    the reference's negative a sign flipped
    all zero                 nothing arrived (a skipped all-reduce on a rank that had no data)
    NaN or inf               an overflow or a division by zero
    only part differs        one slice wrong: a rank's share, one shard, some tokens

and `assert_close(actual, expected, what, **tolerances)` is torch's check with that
diagnosis first in its message. Nothing here loosens a tolerance: it only explains a failure.
"""

from __future__ import annotations

import torch

# a ≈ k·e reads as "k x the reference" when k·e leaves under 10% of a unexplained: an
# exact 2x (a lost / N on the gradients) fits at 0.
SCALE_MISFIT = 0.1
# Weights after several steps of a wrongly scaled gradient: the first step's update is k x,
# the later ones are taken elsewhere (3 SGD steps with momentum at a lost / 2: 1.6x, 17%).
BLURRED_MISFIT = 0.3


def diagnose(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """One phrase for how `actual` differs from `expected` (same shape)."""
    a = actual.detach().double().flatten()
    e = expected.detach().double().flatten()
    if not torch.isfinite(a).all():
        return f"hold NaN or inf ({int((~torch.isfinite(a)).sum())} of {a.numel()} entries)"
    if a.abs().max() == 0 and e.abs().max() > 0:
        return "are all zero where the reference is not"
    if e.abs().max() > 0:  # the least-squares scale: a ≈ k·e, and how well it fits
        k = (a @ e / (e @ e)).item()
        misfit = ((a - k * e).norm() / a.norm().clamp_min(1e-30)).item()
        if misfit < SCALE_MISFIT and abs(k - 1) > SCALE_MISFIT:
            if abs(k + 1) < SCALE_MISFIT:
                return "are the reference's negative (a sign flipped)"
            return f"are {k:.2g}x the reference's (a scale factor lost or doubled)"
        if misfit < BLURRED_MISFIT and abs(k - 1) > SCALE_MISFIT:
            return (
                f"are about {k:.2g}x the reference's (a scale, blurred by later steps)"
            )
    wrong = (a - e).abs() > 1e-3 * (e.abs().max() + 1e-30)
    if 0 < int(wrong.sum()) < a.numel():
        first = int(wrong.nonzero()[0])
        return (
            f"differ in {int(wrong.sum())} of {a.numel()} entries, the first at {first}"
        )
    return f"differ everywhere, max |diff| {(a - e).abs().max().item():.2e}"


def assert_close(actual, expected, what: str, reference: str = "one process", **tol):
    """torch.testing.assert_close, whose message opens with what broke in a reader's words:
    `rank 1's gradient of h.0.mlp.c_fc.weight are 2x one process's (...)`."""
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as error:
        words = diagnose(actual, expected).replace("the reference", reference)
        raise AssertionError(f"{what} {words}\n{error}") from None
