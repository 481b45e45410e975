"""bench/bench_exit.py: do 03's and 07's wrappers let a rank exit cleanly? (issue 30, item 3)

Runs tests/ddp_exit_job.py: short 2-rank jobs that wrap a model in 03's DataParallel or 07's
ZeRO-2/ZeRO-3, train it in a function that returns (the wrapper freed at once, as user code and
the CS336 tests do), destroy the process group and exit. Two busy processes load the 2 cores and
the GIL switch interval is 1 s (SWITCH_S), the setting that made the gloo abort most likely
(SIGABRT at exit, "terminate called without an active exception": see support/handles.py). It
counts the jobs whose ranks did not all exit with 0, with the lessons as shipped and, as the
control, with support/handles.py's retire() made to drop every handle at once (RETIRE=0).

Run:  python bench/bench_exit.py [--jobs 100] [--no-control]     (about 4 min per 100 jobs idle)

The counts so far (moved here from tests/test_ddp.py, whose suite test is now 4 jobs
without the busy processes: a plumbing check). Before the fix, with this setting
(SWITCH_S=1.0, two busy processes), when the script alternated the naive and bucketed
wrappers and both launched collectives in backward: 3 and 4 of 30 jobs aborted, 2, 9 and
11 of 40 with an earlier version, about 12% a job; without the busy processes it almost
never showed (0 of 80). After the fix: 0 of 150. Removing only the kept handles (weak
hooks left) aborted 1 to 7 of 30. The naive wrapper all-reduces after backward, outside
it, and cannot have the bug (30 naive-only jobs: 0). DataParallel with its handles
dropped the moment they are waited (broken on purpose), on 2 loaded cores: 3, 1, 5 and 0
of 30 jobs, then 2 and 1 of 30, about 6% a job; launched from hooks alone, 1 of 165.
ZeRO-3 with its backward all-gathers dropped once waited: 1 of 30 and 3 of 45; the
reduce-scatters dropped once waited: 1 of 212 ZeRO-2 and ZeRO-3 jobs; keeping only the
last one until step(): 1 of 15 ZeRO-2 jobs in a CI run (2026-11-26). Every reduce-
scatter kept a step: 0 of 90; kept to the zero_grad() after next: 0 of 60; 0 of 264
before those changes. Since 2026-11-27 the lessons hand every waited handle to
support/handles.py's retire(): 0 of 60 jobs aborted, and with retire() made a no-op
(RETIRE=0, the control) 0 of 40 on that day's loaded 2-core machine: on this torch the
abort did not reproduce at all.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "ddp_exit_job.py"


def run(jobs: int, retire: bool) -> str:
    """One batch of jobs under load: the job script's summary line and its wall time."""
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
    ]
    env = {**os.environ, "SWITCH_S": "1.0", "RETIRE": "1" if retire else "0"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(JOB), str(jobs)],
            capture_output=True,
            text=True,
            env=env,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    seconds = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    summary = lines[0] if lines else f"no summary (exit {proc.returncode})"
    aborts = proc.stderr.count("terminate called")
    return f"{summary}; 'terminate called' {aborts} times; {seconds:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument(
        "--no-control", action="store_true", help="skip the RETIRE=0 run"
    )
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} cores, 2 busy processes, SWITCH_S=1.0, {args.jobs} jobs each"
    )
    print(f"as shipped:        {run(args.jobs, retire=True)}", flush=True)
    if not args.no_control:
        print(f"retire() disabled: {run(args.jobs, retire=False)}", flush=True)


if __name__ == "__main__":
    main()
