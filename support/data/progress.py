"""A progress line redrawn in place: what is done of the total, the rate and the ETA."""

import time


def progress(
    what: str, done: float, total: float, start: float, unit: str = ""
) -> None:
    """Redraw one progress line in place, with the rate and ETA; done >= total ends it.

    `start` is the time.perf_counter() when the work began; `unit` follows each number
    (" MB" gives "12.0/40.0 MB, 6.0 MB/s").
    """
    elapsed = time.perf_counter() - start
    rate = done / max(elapsed, 1e-9)
    eta = elapsed / max(done, 1e-9) * (total - done)
    counts = f"{done:,.1f}/{total:,.1f}{unit}, {rate:,.1f}{unit}/s"
    status = f"{counts}, ETA {eta:.0f} s ({elapsed:.0f} s in)"
    print(f"\r  {what}: {status}", end="\n" if done >= total else "", flush=True)
