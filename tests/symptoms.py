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

# A ratio that varies by under 5% over the entries reads as one scale factor.
SCALE_SPREAD = 0.05


def diagnose(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """One phrase for how `actual` differs from `expected` (same shape)."""
    a = actual.detach().double().flatten()
    e = expected.detach().double().flatten()
    if not torch.isfinite(a).all():
        return f"hold NaN or inf ({int((~torch.isfinite(a)).sum())} of {a.numel()} entries)"
    if a.abs().max() == 0 and e.abs().max() > 0:
        return "are all zero where the reference is not"
    big = e.abs() > 1e-3 * e.abs().max()  # ratios of near-zero entries are noise
    if big.any():
        ratio = a[big] / e[big]
        k = ratio.median().item()
        spread = (ratio - k).abs().max().item() / max(abs(k), 1e-30)
        if spread < SCALE_SPREAD and abs(k - 1) > SCALE_SPREAD:
            if abs(k + 1) < SCALE_SPREAD:
                return "are the reference's negative (a sign flipped)"
            return f"are {k:.3g}x the reference's (a scale factor lost or doubled)"
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
