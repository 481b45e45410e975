"""The CUDA-only branches of docs/cluster.md that a short program can check on one GPU, each
printed as `PASS` or `FAIL` with what was measured. bench/gpu_run.sh runs it with the rest.

    python bench/gpu_checks.py        (needs a GPU; 14 s on an H200)

Eight checks; the fourth prints a line per recomputation mode. On a GPU without bf16 (V100, T4)
the third and fifth report that, as they should. The seventh and eighth need `python 01_data.py`
run first (data/stdlib-bpe4096).

1. the loss scaler's inf flag on the GPU for an optimizer with no gradients (06; NCCL needs it);
2. 04's RNGStateTracker with the CUDA generator: the fork's stream is its own, the default
   stream goes on as if the fork never happened;
3. which attention kernel SDPA runs for 02's attention, per dtype (torch.profiler's names);
4. recomputation (02, selective and full) with dropout on CUDA's generator: loss and gradients
   against no recomputation, beside a second run without it (the GPU's own run-to-run noise);
5. --dtype auto (train.resolve_dtype) picks bf16 where torch.cuda.is_bf16_supported();
6. the card's dense peaks in support/gpus.py's table (MFU's denominator);
7. train.py's plain steps make no host-device sync from the project's files, seen by CUDA itself
   (torch.cuda.set_sync_debug_mode("warn") during each step that neither logs, evaluates nor
   checkpoints; tests/test_train_sync.py counts the calls on a CPU, this is the GPU's word);
8. support/prefetch.py on CUDA: the batches it copied ahead on its side stream equal 01's
   DataLoader's, in order and after a jump (a resume), on this GPU.
"""

import importlib
import signal
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: numbered files
model_lib = importlib.import_module("02_model")
tp_lib = importlib.import_module("04_tensor_parallel")
mp_lib = importlib.import_module("06_mixed_precision")
recompute_lib = importlib.import_module("06b_recompute")
gpus = importlib.import_module("support.gpus")
data_lib = importlib.import_module("01_data")
train = importlib.import_module("train")
Prefetcher = importlib.import_module("support.prefetch").Prefetcher
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "stdlib-bpe4096"  # python 01_data.py's default output


def report(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def scaler_without_gradients(device) -> bool:
    p = torch.nn.Parameter(torch.ones(3, device=device))  # never given a .grad
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler = mp_lib.DynamicLossScaler()
    scaler.unscale_(optimizer)
    flag = scaler._state(optimizer)["found_inf"]
    return report("scaler, no gradients", flag.device.type == "cuda" and flag.item() == 0,
                  f"found_inf on {flag.device}, value {flag.item()}")  # fmt: skip


def rng_tracker(device) -> bool:
    torch.manual_seed(0)  # every device's generator
    plain = [torch.rand(4, device=device) for _ in range(2)]  # the default stream, no fork
    torch.manual_seed(0)  # every device's generator
    tracker, first = tp_lib.RNGStateTracker(device, seed=7), torch.rand(4, device=device)
    with tracker.fork():
        forked = torch.rand(4, device=device)
    second = torch.rand(4, device=device)
    again = tp_lib.RNGStateTracker(device, seed=7)
    with again.fork():
        same = torch.rand(4, device=device)
    ok = first.equal(plain[0]) and second.equal(plain[1]) and forked.equal(same)
    ok &= not forked.equal(plain[1])
    return report("RNGStateTracker on CUDA", ok, "default stream untouched by the fork, the fork's "
                  "stream repeats from its seed, and differs from the default")  # fmt: skip


def attention_kernels(device) -> bool:
    config = model_lib.GPTConfig.from_preset("gpt2", n_layer=1, vocab_size=256)
    model = model_lib.GPT(config).to(device)
    x = torch.randint(0, 256, (2, config.block_size), device=device)
    found = {}
    for name, dtype in mp_lib.DTYPES.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with mp_lib.autocast_context(dtype, "cuda"):
                _, loss = model(x, x)
            loss.backward()
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
        found[name] = sorted(k for k in names if any(w in k.lower() for w in
                             ("flash", "fmha", "attention", "cudnn")))[:3]  # fmt: skip
    for name, kernels in found.items():
        print(f"      {name}: {kernels}")
    flash = {d: any("flash" in k.lower() for k in found[d]) for d in ("bf16", "fp16")}
    return report("SDPA kernel", all(flash.values()), f"a flash kernel in 16 bits: {flash}")


def recompute_with_dropout(device) -> bool:
    """One forward and backward per mode, the same init and CUDA seed: the replay must redraw the
    same dropout masks (torch's checkpoint rewinds the CUDA generator)."""
    base = model_lib.GPTConfig.from_preset("small", vocab_size=256, dropout=0.1)
    x = torch.randint(0, 256, (8, base.block_size), device=device)
    results = {}
    for mode in ("none", "none again", "selective", "full"):
        torch.manual_seed(0)
        model = model_lib.GPT(base).to(device)
        recompute_lib.apply_recomputation(model, mode.split()[0])  # 06b, from outside
        torch.manual_seed(1)
        with torch.autocast(device.type, torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        results[mode] = [loss.detach()] + [p.grad for p in model.parameters()]
    ok = True
    for mode in ("none again", "selective", "full"):
        diff = max((a - b).abs().max().item() for a, b in zip(results["none"], results[mode]))
        ok &= report(f"recompute {mode} with dropout", diff == 0, f"loss and every gradient "
                     f"against none: max |diff| {diff:.1e}")  # fmt: skip
    return ok


def auto_dtype(device) -> bool:
    dtype = train.resolve_dtype(train.TrainConfig(dtype="auto"), device)
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    detail = f"{dtype} (torch.cuda.is_bf16_supported(): {torch.cuda.is_bf16_supported()})"
    return report("--dtype auto", dtype == want, detail)


def peaks() -> bool:
    name = torch.cuda.get_device_name()
    table = {d: gpus.peak_flops(name, d) for d in ("bf16", "fp16", "tf32", "fp32")}
    return report("peak FLOP/s known", table["bf16"] is not None, f"{name!r}: {table}")


def ours(filename: str) -> bool:
    """A file of the project: the numbered lessons, train.py, support/ (not torch, not bench)."""
    path = Path(filename).resolve()
    return path.parent in (ROOT, ROOT / "support") and path.suffix == ".py"


def blame(stack) -> str:
    """Whose sync: "ours" when the Python line that made it is in our files, or in torch's
    Tensor dunders (torch/_tensor*.py: format, repr, bool ...) called from our files;
    "torch" when torch's own Python code makes it, inside a call of ours."""
    frames = [f for f in stack if not f.filename.endswith(("gpu_checks.py", "warnings.py"))]
    inner = frames[-1]
    if ours(inner.filename):
        return "ours"
    dunder = Path(inner.filename).name.startswith("_tensor") and len(frames) > 1
    return "ours" if dunder and ours(frames[-2].filename) else "torch"


def plain_steps_sync_free(device) -> bool:
    """train.py for 12 steps (a log line at steps 0, 10 and 11, no evaluation, no checkpoint),
    every train_step under CUDA's sync debug mode: each synchronizing call warns, in the
    thread that made it, where its stack is read. Steps 1-9 are plain. Syncs in the
    prefetch thread (support/prefetch.py) stall only that thread, and are listed apart."""
    real_step = train.train_step
    seen = {"ours": [], "torch": [], "prefetch thread": []}

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()
        thread = threading.current_thread() is not threading.main_thread()
        who = "prefetch thread" if thread else blame(stack)
        seen[who].append(f"{Path(filename).name}:{lineno}")

    def watched(run, step):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return real_step(run, step)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    argv = ["--model", "small", "--data-dir", str(DATA), "--max-steps", "12"]
    argv += ["--log-interval", "10", "--eval-interval", "0", "--ckpt-interval", "0"]
    argv += ["--sample-tokens", "0", "--dtype", "bf16"]
    train.train_step = watched
    try:
        with tempfile.TemporaryDirectory() as out:
            train.main(argv + ["--out-dir", out])
    finally:
        train.train_step = real_step
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # train.main's preemption handlers:
            signal.signal(sig, signal.SIG_DFL)  # a timeout must still stop this script.
    for who in ("torch", "prefetch thread"):
        print(f"      {who}: {len(seen[who])} syncs {seen[who][:5]}")
    detail = f"{len(seen['ours'])} syncs from our files in 12 steps {seen['ours'][:5]}"
    return report("plain steps sync-free", not seen["ours"], detail)


def prefetch_on_cuda(device) -> bool:
    """Steps 0, 1, 2, then 7, 8 (a jump, as after a resume) through the Prefetcher on CUDA
    against the same DataLoader's batches copied by hand: equal, on the GPU."""
    loader = data_lib.DataLoader(str(DATA), "train", 8, 128, 0, 0, 1)
    ahead = Prefetcher(loader, device)
    ok = True
    try:
        for step in (0, 1, 2, 7, 8):
            got = ahead.get_batch(step)
            want = [t.to(device) for t in loader.get_batch(step)]
            ok &= all(g.device.type == "cuda" and g.equal(w) for g, w in zip(got, want))
    finally:
        ahead.close()
    return report("prefetch on CUDA", ok, "steps 0, 1, 2, 7, 8: equal to on-demand batches")


def main() -> None:
    assert torch.cuda.is_available(), "gpu_checks.py needs a CUDA GPU"
    device = torch.device("cuda")
    print(gpus.machine(), f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    checks = (scaler_without_gradients, rng_tracker, attention_kernels, recompute_with_dropout,
              auto_dtype)  # fmt: skip
    if DATA.is_dir():  # The two train.py checks read python 01_data.py's tokens.
        checks += (plain_steps_sync_free, prefetch_on_cuda)
    else:
        print(f"skipping checks 7 and 8: no {DATA} (run python 01_data.py first)")
    results = [check(device) for check in checks] + [peaks()]
    print(f"{sum(results)} of {len(results)} checks passed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
