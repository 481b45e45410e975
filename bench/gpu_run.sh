#!/usr/bin/env bash
# bench/gpu_run.sh: every CUDA path of the course on one GPU, and the GPU's measurements, in one
# go (GPU time is scarce: one call runs the whole list). Each section writes RESULTS/NAME.log and
# a line to RESULTS/summary.txt (exit code, seconds); a section that fails or hangs (its timeout)
# does not stop the others. With PACK, RESULTS is packed there after phase 1 and after every
# section of phase 2, so a run cut short still leaves what it finished. docs/results.md holds what
# it printed on an H200 (there in two calls: the rows of phase 2's second half came later).
#
#   python 01_data.py && python 01_data.py --tokenizer gpt2      # the data, once (GPT-2's
#   bash bench/gpu_run.sh out/gpu [out/gpu.tar.gz]                # tokenizer: TIKTOKEN_CACHE_DIR)
#
# Needs a GPU with 48 GB or more (gpt2-medium at B = 32 peaks at 41 GiB); about 10 minutes on an
# H200, whose speed the timeouts assume. It deletes /tmp/gpu_runs (train.py's run folders) first.
# Read: every line of summary.txt says exit 0 (a timeout is 124), gpu_tests.log ends "10
# passed", compare.log says "bit-exact True" twice; the numbers are in the timing sections' logs.
# PYTHON picks the interpreter (python3); PHASES=1 runs phase 1 alone (to try the script);
# PHASES=speed runs only issue 31's measurements (speed_phase, below).
#
# Phase 1 checks correctness, its jobs side by side (nothing is timed); phase 2 times, one job
# at a time, the most wanted first.
set -u
W=${1:-out/gpu}
PACK=${2:-}
R=/tmp/gpu_runs  # train.py's run folders: checkpoints of GPT-2 124M are 1.5 GB, kept out of W
rm -rf "$R"
mkdir -p "$W" "$R"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1)

section() {  # section NAME TIMEOUT_S COMMAND...: run it, log its output and its exit code
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    # -k: train.py takes SIGTERM as preemption (it saves, then exits): KILL 20 s later.
    timeout -k 20 "$limit" "$@" >"$W/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc, $((SECONDS - t0)) s: $*" >>"$W/summary.txt"
}

pack() {  # after each phase-2 section: what a cut-short run leaves
    if [ -n "$PACK" ]; then tar -czf "$PACK" -C "$W" .; fi
}

small() {  # small NAME ARGS...: train.py on the 4-layer model and the 4,096-token BPE data
    local name=$1
    shift
    section "$name" 120 "$@" --model small --data-dir data/stdlib-bpe4096 --out-dir "$R/$name"
}

train_series() {  # the dtypes, a resume against a straight run (and a second straight run: the
    # GPU's own run-to-run noise), --export and --sample; dropout on, so the CUDA RNG state counts
    small fp32 "$PY" train.py --dtype fp32 --max-steps 20 --log-interval 5 --eval-interval 10 \
        --sample-tokens 40
    small bf16 "$PY" train.py --dtype bf16 --max-steps 20 --log-interval 5 --eval-interval 10 \
        --sample-tokens 40
    small fp16 "$PY" train.py --dtype fp16 --max-steps 20 --log-interval 5 --eval-interval 10 \
        --sample-tokens 40
    local resume=(--dropout 0.1 --max-steps 20 --ckpt-interval 10 --log-interval 1
        --eval-interval 0 --sample-tokens 0)  # --dtype auto: bf16 on a GPU that has it
    small straight "${TORCHRUN[@]}" train.py "${resume[@]}"
    small straight_again "${TORCHRUN[@]}" train.py "${resume[@]}"
    small split "${TORCHRUN[@]}" train.py "${resume[@]}" --steps-this-run 10
    section resumed 120 "${TORCHRUN[@]}" train.py "${resume[@]}" --model small \
        --data-dir data/stdlib-bpe4096 --out-dir "$R/split" --resume
    section compare 60 "$PY" -c '
import json, sys
def rows(name):  # every train row, step -> (loss, grad_norm)
    lines = open(f"{sys.argv[1]}/{name}/metrics.jsonl").read().splitlines()
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, lines)
            if r["kind"] == "train"}
resumed = open(sys.argv[2]).read()  # a resume that found no checkpoint restarts from step 0
assert "resumed from" in resumed and "(step 9)" in resumed, "the second half did not resume"
a, again, split = rows("straight"), rows("straight_again"), rows("split")
assert sorted(a) == sorted(split) == list(range(20)), (sorted(a), sorted(split))
print("steps", sorted(split), "; the second half resumed from the step-9 checkpoint")
same = True
for name, other in (("straight again", again), ("stopped at 10 and resumed", split)):
    diff = max(abs(x - y) for s in a for x, y in zip(a[s], other[s]))
    same &= all(a[s] == other[s] for s in a)
    print(f"{name}: bit-exact {all(a[s] == other[s] for s in a)}, max |diff| {diff:.2e}")
sys.exit(0 if same else 1)
' "$R" "$W/resumed.log"
    section export 120 "$PY" train.py --export "$R/split"
    section sample 120 "$PY" train.py --sample "$R/split/model.pt" --sample-tokens 40
}

demos() {  # every numbered script at world size 1 (03-05c under torchrun: NCCL with one rank)
    section demo_01 120 "$PY" 01_data.py --out "$R/data01"
    section demo_02 120 "$PY" 02_model.py
    section demo_03 120 "$PY" 03_ddp.py --ranks 1
    section demo_03b 120 "$PY" 03b_compression.py --ranks 1
    section demo_04 120 "$PY" 04_tensor_parallel.py --ranks 1
    section demo_04b 120 "$PY" 04b_sequence_parallel.py --ranks 1
    section demo_05 120 "$PY" 05_pipeline.py --ranks 1
    section demo_05b 120 "$PY" 05b_schedules.py --ranks 1
    section demo_05c 120 "$PY" 05c_zero_bubble.py --ranks 1
    section demo_06 120 "$PY" 06_mixed_precision.py
    section demo_06b 120 "$PY" 06b_recompute.py  # --device: cuda when there is one
}

section env 60 bash -c "nvidia-smi; $PY -c 'import torch, triton, tiktoken, numpy; \
print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), triton.__version__, \
tiktoken.__version__, numpy.__version__)'; nproc; free -g"

speed_phase() {  # PHASES=speed: issue 31's numbers (and 32's kernel timing) alone, the most
    # wanted first. Not run yet: each train.py section compiles (about a minute cold), so the
    # default SPEED_MODELS=gpt2 (8 sections) fits one 10-minute call; SPEED_MODELS=gpt2-medium
    # is a second call (its micro-batch 64 needs about 80 GiB: run only on a GPU of 100 GiB
    # or more). Carry data/stdlib-gpt2 and data/stdlib-bpe4096, or prepare them there
    # (python 01_data.py, with and without --tokenizer gpt2). train.py against the lean step
    # at the same micro-batch, with each loss.
    # The GPU's tests (correctness, not timings): no sync in plain steps, the prefetch.
    section gpu_tests 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py
    section ring_kernel 120 "$PY" bench/bench_ring_kernel.py  # 08's blocks against SDPA
    pack
    local gpt2=(--data-dir data/stdlib-gpt2 --dtype bf16 --compile --max-steps 30 --warmup-steps 5
        --lr 6e-4 --log-interval 10 --eval-interval 0 --ckpt-interval 0 --sample-tokens 0)
    local gib model micro loss
    gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    gib=$(( ${gib:-0} / 1024 ))
    for model in ${SPEED_MODELS:-gpt2}; do
        section "lean_${model}_b32" 150 "$PY" bench/bench_compiled_step.py --presets "$model" \
            --batch-size 32
        pack
        for micro in 32 64; do
            if [ "$model" != gpt2 ] && [ "$micro" = 64 ] && [ "$gib" -lt 100 ]; then
                echo "${model}_64: skipped, ${gib} GiB < 100" >>"$W/summary.txt"
                continue
            fi
            for loss in plain chunked; do
                section "train_${model}_${micro}_${loss}" 180 "$PY" train.py --model "$model" \
                    "${gpt2[@]}" --batch-size 64 --micro-batch-size "$micro" --loss "$loss" \
                    --out-dir "$R/${model}_${micro}_${loss}"
                cp "$R/${model}_${micro}_${loss}/metrics.jsonl" \
                    "$W/train_${model}_${micro}_${loss}.jsonl" 2>/dev/null
                pack
            done
        done
        [ "$model" = gpt2 ] && section lean_gpt2_b64 150 "$PY" bench/bench_compiled_step.py \
            --presets gpt2 --batch-size 64 && pack
        [ "$model" = gpt2 ] && section loss_bytes 150 "$PY" bench/bench_loss.py --measure 16,32 \
            && pack
    done
    section speed_table 30 "$PY" -c '
import glob, json, os, statistics
for path in sorted(glob.glob(os.path.join(os.sys.argv[1], "train_*.jsonl"))):
    rows = [json.loads(line) for line in open(path)]
    rows = [r for r in rows if r["kind"] == "train" and r["step"] >= 10]  # compiled by then
    if rows:
        tok = statistics.median(r["tokens_per_s"] for r in rows)
        mfu = statistics.median(r["mfu"] for r in rows)
        mem = max(r["peak_mem_gb"] for r in rows)
        name = os.path.basename(path)[6:-6]
        print(f"{name:28s} {tok:>10,.0f} tok/s  mfu {100 * mfu:.1f}%  peak {mem:.1f} GB")
' "$W"
    cat "$W/speed_table.log" "$W/summary.txt"
    pack
}

if [ "${PHASES:-12}" = speed ]; then
    speed_phase
    exit 0
fi

# phase 1: correctness, side by side
# The GPU's tests (tests/test_gpu.py, skipped without CUDA): correctness, not timings.
section gpu_tests 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py &
train_series &
demos &
wait
pack
[ "${PHASES:-12}" = 1 ] && exit 0  # (PHASES=1: phase 1 alone, to try the script on a CPU)

# phase 2: timings, one at a time
section precision 150 "$PY" bench/bench_mixed_precision.py --steps 25 --warmup 5
pack
section gpt2_compile 200 "$PY" train.py --model gpt2 --data-dir data/stdlib-gpt2 --dtype bf16 \
    --compile --batch-size 64 --micro-batch-size 32 --max-steps 40 --warmup-steps 5 --lr 6e-4 \
    --log-interval 10 --eval-interval 0 --eval-steps 2 --ckpt-interval 0 --sample-tokens 0 \
    --out-dir "$R/gpt2"
cp "$R/gpt2/metrics.jsonl" "$W/gpt2_metrics.jsonl" 2>/dev/null
pack
section gpt2_compile_m64 200 "$PY" train.py --model gpt2 --data-dir data/stdlib-gpt2 \
    --dtype bf16 --compile --batch-size 64 --micro-batch-size 64 --max-steps 40 --warmup-steps 5 \
    --lr 6e-4 --log-interval 10 --eval-interval 0 --eval-steps 2 --ckpt-interval 0 \
    --sample-tokens 0 --out-dir "$R/gpt2_m64"  # one microbatch: no accumulation
pack
section compiled_step 240 "$PY" bench/bench_compiled_step.py --presets gpt2,gpt2-medium \
    --profile-dir "$W/profile"
pack
section bench_model 90 "$PY" bench/bench_model.py --steps 10
pack
section compiled_step_b64 90 "$PY" bench/bench_compiled_step.py --presets gpt2 --batch-size 64
pack
section compiled_step_large 240 "$PY" bench/bench_compiled_step.py --presets gpt2-large,gpt2-xl \
    --batch-size 16
pack
cat "$W/summary.txt"
