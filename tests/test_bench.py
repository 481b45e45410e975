"""Every bench script runs, at its smallest, so none can rot unseen.

bench/ only measures, so its numbers are not checked here (a loaded 2-core VM would make
them noise); what is checked is that each script still runs end to end against today's
lessons, train.py and support/, and prints its result lines. Sizes are the smallest each
script takes (a tiny model, one or two timed steps); scripts that want CUDA run their
CPU variant, and the multi-rank ones run two gloo ranks.

Each script runs as `python bench/NAME.py ARGS` would, as __main__, but in a process
forked from tests/distributed.py's zygotes, which have imported torch already: a fresh
interpreter spends 3-6 s of CPU on that import alone, and there are fifteen scripts.
tests/test_house.py checks that every script in bench/ has a row in SMOKE.
"""

import contextlib
import importlib
import io
import os
import runpy
import sys
from pathlib import Path

import pytest

from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
# A script that starts its own worlds runs in this process, not in a forked rank: its worlds
# then fork from the session's zygotes, which have imported torch already. A forked rank has
# no zygotes, so it would start fresh ones: bench_pipeline's row took 33 s so, mostly their
# imports, on this VM's 2 shared cores.
WORLDS = -1


def run_script(rank, world_size, script: str, argv: list, distributed: bool) -> str:
    """In a forked rank: bench/`script` as __main__ with `argv`; what it printed.

    A script that is not distributed gets no torchrun variables (train.py would otherwise
    join a process group of one)."""
    if not distributed:
        for key in (*TORCHRUN_ENV, "MASTER_PORT"):
            os.environ.pop(key, None)
    path = str(ROOT / "bench" / script)
    sys.argv = [path, *argv]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(path, run_name="__main__")
    return printed.getvalue()


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """This repository's docs as 01's char tokens: train.py's --data-dir. Their val split
    holds more than the 16 windows of 128 tokens one rank of bench_train's step reads."""
    data = importlib.import_module("01_data")
    out = tmp_path_factory.mktemp("char")
    data.prepare(str(ROOT / "docs" / "*.md"), "char", out, block_size=128)
    return str(out)


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory, gpt2_encoding):
    """The docs in GPT-2's tokens: bench_finetune's base model reads them."""
    data = importlib.import_module("01_data")
    out = tmp_path_factory.mktemp("gpt2")
    data.prepare(str(ROOT / "docs" / "*.md"), "gpt2", out, block_size=128)
    return str(out)


# script -> (its smallest arguments, ranks (0: not distributed; WORLDS: it starts its own
# gloo worlds with tests/distributed.py's run_ranks), a line it must print).
# "{tmp}", "{char}" and "{gpt2}" are filled in by the test.
SMOKE = {
    "bench_compiled_step.py": (
        "--device cpu --no-compile --presets tiny --batch-size 1 --steps 1 --warmup 1",
        0,
        "tok/s",
    ),
    "bench_compression.py": ("--parts codec --skip-gpt2 --reps 1", 0, "break-even"),
    "bench_context_parallel.py": (
        "--seq-lens 32 64 --time-seq-len 64 --steps 1 --warmup 0",
        2,
        "hidden",
    ),
    "bench_data.py": (
        "--source README.md --small-kb 5 --vocab-size 300 --skip-reference",
        0,
        "[3] prepare",
    ),
    "bench_ddp.py": ("--steps 1 --warmup 0 --cases 1", 2, "ZeRO-3 / FSDP2"),
    "bench_finetune.py": (
        "--base-steps 2 --steps 2 --base-data {gpt2}",
        0,
        "AdamW state",
    ),
    "bench_loss.py": (
        "--preset small --block-size 64 --measure 1 --batch-sizes 1 --steps 1"
        " --chunk-tokens 32",
        0,
        "chunked",
    ),
    "bench_mixed_precision.py": (
        "--steps 2 --warmup 1 --batch-size 1 --modes fp32,fp16-by-hand",
        0,
        "the same scales and losses, to the last bit: True",
    ),
    "bench_model.py": (
        "--steps 1 --warmup 0 --batch-size 1 --small-vocab 256",
        0,
        "speed-up",
    ),
    "bench_pipeline.py": (
        "--p 2 --m 2 --steps 1 --b 1 --T 16 --n-embd 32 --out-dir {tmp}",
        WORLDS,
        "formula: (p-1)/(v·m+p-1)",
    ),
    "bench_ring_kernel.py": (
        "--seq-lens 64 --batch-size 1 --heads 2 --steps 1 --tile 32 --skip-rss",
        0,
        "08 tile 32",
    ),
    "bench_schedules.py": (
        "--steps 2 --model tiny --data-dir {char} --out {tmp} --figure {tmp}/s.png",
        0,
        "| --lr-schedule |",
    ),
    "bench_tensor_parallel.py": (
        "--preset tiny --batch-size 1 --steps 1 --warmup 0",
        2,
        "sequence parallel",
    ),
    "bench_train.py": (
        "--ranks 2 --steps 2 --layouts dp2 --data-dir {char}",
        0,
        "dp2",
    ),
}


# Scripts that cannot be fast even at their smallest: each runs train.py jobs whose fixed
# costs (a fresh torchrun job of new interpreters; three runs at GPT-2's 50,257-token
# vocabulary) take 30 to 50 s of CPU. BENCH_SMOKE_ALL=1 runs them too.
SLOW = {
    "bench_finetune.py": "three train.py runs at GPT-2's vocabulary: ~50 s of CPU",
    "bench_train.py": "a torchrun job of fresh interpreters: ~30 s of CPU",
}


def smoke_case(script):
    if script not in SLOW:
        return script
    skip = not os.environ.get("BENCH_SMOKE_ALL")
    why = f"slow: {SLOW[script]} (BENCH_SMOKE_ALL=1 runs it)"
    return pytest.param(script, marks=pytest.mark.skipif(skip, reason=why))


@pytest.mark.parametrize("script", [smoke_case(s) for s in sorted(SMOKE)])
def test_bench_script_runs(script, tmp_path, request):
    argv, ranks, expected = SMOKE[script]
    fill = {"tmp": str(tmp_path)}
    if "{char}" in argv:
        fill["char"] = request.getfixturevalue("char_data")
    if "{gpt2}" in argv:
        fill["gpt2"] = request.getfixturevalue("gpt2_data")
    argv = [a.format(**fill).replace("-by-", " by ") for a in argv.split()]
    if ranks == WORLDS:
        printed = [in_this_process(script, argv)]
    else:
        printed = run_ranks(
            run_script, max(1, ranks), script, argv, ranks > 0, timeout=300, init=False
        )
    assert expected in printed[0], printed[0]


def in_this_process(script: str, argv: list) -> str:
    """run_script in this process, its sys.argv and sys.path given back afterwards."""
    saved = (sys.argv, list(sys.path))
    try:
        return run_script(0, 1, script, argv, distributed=False)
    finally:
        sys.argv, sys.path[:] = saved
