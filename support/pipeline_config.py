"""The pipeline's settings, checked before any message is sent (05 and train.py).

A bad setting found after the first send would leave the other ranks blocked in a
receive, so every check runs first, on every rank, with the same answer everywhere.
"""

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def check_config(schedule, p, m, v=1, n_layer=None, batch_size=None):
    """Every bad (schedule, p, m, v, layers, batch) raises ValueError here."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    if min(p, m, v) < 1:
        raise ValueError(f"need pp_size, microbatches, v >= 1, got {p}, {m}, {v}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_stages={v} needs schedule='interleaved'")
    if schedule == "interleaved" and m % p != 0:  # microbatches go round p at a time
        raise ValueError(f"interleaved: m divisible by pp_size, not m={m}, p={p}")
    if n_layer is not None and n_layer < p * v:
        raise ValueError(f"{n_layer} blocks cannot fill pp_size*v = {p}*{v} stages")
    if batch_size is not None and batch_size % m != 0:
        raise ValueError(f"batch {batch_size} does not split into {m} microbatches")
