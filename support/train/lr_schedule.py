"""train.py's learning rate: its warm-up, then one of four schedules, a pure function
of the step (so a resume continues it). train.py imports lr_at and LR_SCHEDULES from
here; bench/bench_schedules.py draws them (docs/lr_schedules.png).
"""

import math

from support.train.config import TrainConfig

# After the warm-up (lr_at); docs/lr_schedules.png draws them.
LR_SCHEDULES = ("cosine", "wsd", "cyclic", "constant")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate at `step`, a pure function of it (a resume continues it).

    Warm-up: hi·(step + 1)/w for step < w = warmup_steps. Then, with hi = lr, lo =
    min_lr, L = max_steps - 1 the last step trained (at lo) and p the fraction of the
    decay done, capped at 1:
      cosine    lo + (hi - lo)(1 + cos πp)/2, p = (step - w)/(L - w)   (GPT-2)
      wsd       (warm-up, stable, decay: Hu et al. 2024, arXiv 2404.06395) hi until
                s = L - d, d = round(decay_fraction·max_steps) >= 1 (s >= w), then
                lo + (hi - lo)(1 - p), p = (step - s)/(L - s): one step of decay is lo.
      cyclic    lo + (hi - lo)|1 - 2q|, q = ((step - w) mod cycle_steps)/cycle_steps
                (Smith 2017, arXiv 1506.01186: his triangle, begun at its top)
      constant  hi
    A resume with a larger --max-steps follows the longer schedule from its step on:
    WSD's stable phase goes on unchanged, a cosine jumps up to the stretched curve.
    """
    w = cfg.warmup_steps
    hi = cfg.lr
    lo = cfg.min_lr
    last = cfg.max_steps - 1
    if step < w:
        return hi * (step + 1) / w
    if cfg.lr_schedule == "cyclic":
        q = ((step - w) % cfg.cycle_steps) / cfg.cycle_steps
        return lo + (hi - lo) * abs(1 - 2 * q)
    if cfg.lr_schedule == "constant":
        return hi
    start = w  # Cosine decays from the warm-up's end, wsd from L - d.
    if cfg.lr_schedule == "wsd":
        d = max(1, round(cfg.decay_fraction * cfg.max_steps))
        start = max(w, last - d)
    p = min(1.0, max(0, step - start) / max(1, last - start))
    if cfg.lr_schedule == "wsd":
        return lo + (hi - lo) * (1 - p)
    return lo + (hi - lo) * 0.5 * (1 + math.cos(math.pi * p))
