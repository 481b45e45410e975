"""bench/bench_exit.py: do 03's and 07's wrappers let a rank exit cleanly? (issue 30, item 3)

Runs tests/ddp_exit_job.py: short 2-rank jobs that wrap a model in 03's DataParallel or 07's
ZeRO-2/ZeRO-3, train it in a function that returns (the wrapper freed at once, as user code and
the CS336 tests do), destroy the process group and exit. Two busy processes load the 2 cores and
the GIL switch interval is 1 s (SWITCH_S), the setting that made the gloo abort most likely
(SIGABRT at exit, "terminate called without an active exception": see support/handles.py). It
counts the jobs whose ranks did not all exit with 0, with the lessons as shipped and, as the
control, with support/handles.py's retire() made to drop every handle at once (RETIRE=0).

Run:  python bench/bench_exit.py [--jobs 100] [--no-control]     (about 4 min per 100 jobs idle)
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
