"""The CUDA-only branches of docs/cluster.md that a short test can check on one GPU.

Skipped without CUDA (the development VMs have none); bench/gpu_run.sh runs this file as its
own step (`gpu_tests`) on a GPU. About 15 s on an H200.

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
8. support/train/prefetch.py on CUDA: the batches it copied ahead on its side stream equal 01's
   DataLoader's, in order and after a jump (a resume), on this GPU;
9. support/distributed.new_groups on NCCL bound to the GPU: its groups come from dist.split_group with the
   world's timeout (one GPU: one rank's split; two GPUs: build_grid's layouts, one split a
   dimension, each group the formula's ranks and working).
"""

import importlib
import signal
import threading
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.test_grid import NAMES, expected_groups, members

model_lib = importlib.import_module("02_model")
tp_lib = importlib.import_module("04_tensor_parallel")
mp_lib = importlib.import_module("06_mixed_precision")
recompute_lib = importlib.import_module("06b_recompute")
gpus = importlib.import_module("support.gpus")
data_lib = importlib.import_module("01_data")
train = importlib.import_module("train")
Prefetcher = importlib.import_module("support.train.prefetch").Prefetcher
distributed = importlib.import_module("support.distributed")
grid_lib = importlib.import_module("support.train.grid")
pipe = importlib.import_module("05_pipeline")
ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: these check the CUDA-only branches (bench/gpu_run.sh runs them)",
)
BF16 = pytest.mark.skipif(
    torch.cuda.is_available() and not torch.cuda.is_bf16_supported(),
    reason="this GPU has no bf16 (V100, T4)",
)


@pytest.fixture
def device():
    return torch.device("cuda")


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """The README as 01's char tokens: what train.py and the DataLoader read here."""
    out = tmp_path_factory.mktemp("char")
    data_lib.prepare(str(ROOT / "README.md"), "char", out, block_size=128)
    return out


def test_scaler_without_gradients(device):
    p = torch.nn.Parameter(torch.ones(3, device=device))  # never given a .grad
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler = mp_lib.DynamicLossScaler()
    scaler.unscale_(optimizer)
    flag = scaler._state(optimizer)["found_inf"]
    assert flag.device.type == "cuda", f"found_inf on {flag.device}"
    assert flag.item() == 0


def test_rng_tracker_on_cuda(device):
    """The default stream is untouched by the fork, the fork's stream repeats from its seed,
    and differs from the default."""
    torch.manual_seed(0)  # every device's generator
    plain = [torch.rand(4, device=device) for _ in range(2)]  # the default stream, no fork
    torch.manual_seed(0)
    tracker = tp_lib.RNGStateTracker(device, seed=7)
    first = torch.rand(4, device=device)
    with tracker.fork():
        forked = torch.rand(4, device=device)
    second = torch.rand(4, device=device)
    again = tp_lib.RNGStateTracker(device, seed=7)
    with again.fork():
        same = torch.rand(4, device=device)
    assert first.equal(plain[0])
    assert second.equal(plain[1])
    assert forked.equal(same)
    assert not forked.equal(plain[1])


@BF16
def test_sdpa_runs_a_flash_kernel_in_16_bits(device):
    config = model_lib.GPTConfig.from_preset("gpt2", n_layer=1, vocab_size=256)
    model = model_lib.GPT(config).to(device)
    x = torch.randint(0, 256, (2, config.block_size), device=device)
    words = ("flash", "fmha", "attention", "cudnn")
    found = {}
    for name, dtype in mp_lib.DTYPES.items():
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            with mp_lib.autocast_context(dtype, "cuda"):
                _, loss = model(x, x)
            loss.backward()
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
        found[name] = sorted(k for k in names if any(w in k.lower() for w in words))[:3]
        print(f"{name}: {found[name]}")  # shown with pytest -s: which kernels ran
    for dtype in ("bf16", "fp16"):
        assert any("flash" in k.lower() for k in found[dtype]), found


@BF16
@pytest.mark.parametrize("mode", ["none again", "selective", "full"])
def test_recompute_with_dropout_redraws_the_same_masks(device, mode):
    """One forward and backward per mode, the same init and CUDA seed: the replay must redraw
    the same dropout masks (torch's checkpoint rewinds the CUDA generator)."""
    base = model_lib.GPTConfig.from_preset("small", vocab_size=256, dropout=0.1)
    x = torch.randint(0, 256, (8, base.block_size), device=device)
    results = {}
    for run in ("none", mode):
        torch.manual_seed(0)
        model = model_lib.GPT(base).to(device)
        recompute_lib.apply_recomputation(model, run.split()[0])  # 06b, from outside
        torch.manual_seed(1)
        with torch.autocast(device.type, torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        results[run] = [loss.detach()] + [p.grad for p in model.parameters()]
    pairs = zip(results["none"], results[mode])
    diff = max((a - b).abs().max().item() for a, b in pairs)
    assert diff == 0, f"loss and every gradient against none: max |diff| {diff:.1e}"


def test_dtype_auto_picks_bf16_where_supported(device):
    dtype = train.resolve_dtype(train.TrainConfig(dtype="auto"), device)
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert dtype == want


def test_the_gpu_has_a_peak_in_the_table():
    name = torch.cuda.get_device_name()
    table = {d: gpus.peak_flops(name, d) for d in ("bf16", "fp16", "tf32", "fp32")}
    assert table["bf16"] is not None, f"{name!r}: {table}"


def ours(filename: str) -> bool:
    """A file of the project: the lessons, train.py, support/ (not torch, not the tests)."""
    path = Path(filename).resolve()
    mine = path.parent == ROOT or ROOT / "support" in path.parents
    return mine and path.suffix == ".py"


def blame(stack) -> str:
    """Whose sync: "ours" when the Python line that made it is in our files, or in torch's
    Tensor dunders (torch/_tensor*.py: format, repr, bool ...) called from our files;
    "torch" when torch's own Python code makes it, inside a call of ours."""
    frames = [f for f in stack if not f.filename.endswith(("test_gpu.py", "warnings.py"))]
    inner = frames[-1]
    if ours(inner.filename):
        return "ours"
    dunder = Path(inner.filename).name.startswith("_tensor") and len(frames) > 1
    return "ours" if dunder and ours(frames[-2].filename) else "torch"


@BF16
def test_plain_steps_make_no_sync(char_data, tmp_path):
    """train.py for 12 steps (a log line at steps 0, 10 and 11, no evaluation, no checkpoint),
    every train_step under CUDA's sync debug mode: each synchronizing call warns, in the
    thread that made it, where its stack is read. Steps 1-9 are plain. Syncs in the
    prefetch thread (support/train/prefetch.py) stall only that thread, and are listed apart."""
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

    argv = ["--model", "small", "--data-dir", str(char_data), "--max-steps", "12"]
    argv += ["--log-interval", "10", "--eval-interval", "0", "--ckpt-interval", "0"]
    argv += ["--sample-tokens", "0", "--dtype", "bf16", "--out-dir", str(tmp_path)]
    train.train_step = watched
    try:
        train.main(argv)
    finally:
        train.train_step = real_step
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # train.main's preemption handlers:
            signal.signal(sig, signal.SIG_DFL)  # a timeout must still stop this test.
    for who in ("torch", "prefetch thread"):
        print(f"{who}: {len(seen[who])} syncs {seen[who][:5]}")
    assert not seen["ours"], f"{len(seen['ours'])} syncs from our files: {seen['ours'][:5]}"


def test_prefetch_on_cuda_matches_the_loader(char_data, device):
    """Steps 0, 1, 2, then 7, 8 (a jump, as after a resume) through the Prefetcher on CUDA
    against the same DataLoader's batches copied by hand: equal, on the GPU."""
    loader = data_lib.DataLoader(str(char_data), "train", 8, 128, 0, 0, 1)
    ahead = Prefetcher(loader, device)
    try:
        for step in (0, 1, 2, 7, 8):
            got = ahead.get_batch(step)
            want = [t.to(device) for t in loader.get_batch(step)]
            for g, w in zip(got, want):
                assert g.device.type == "cuda"
                assert g.equal(w), f"step {step}"
    finally:
        ahead.close()


GRID_TIMEOUT_S = 90.0  # the world's: torch's default for a group is 10 minutes on NCCL
GRID_LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (pp, dp, tp) on 2 ranks


def _grid_on_nccl(rank, world):
    """NCCL bound to this rank's GPU (support/distributed's init, as train.py's): one rank
    splits the world into [[0]]; two build each of GRID_LAYOUTS's grids. For each: whether
    the world is bound, the timeout each split_group got, each group's ranks, its NCCL
    timeout and an all-reduce of ones over it (its size: the communicator works)."""
    distributed.init_distributed(GRID_TIMEOUT_S)
    real_split, splits = dist.split_group, []

    def split_group(*args, **kwargs):
        splits.append(kwargs.get("timeout"))
        return real_split(*args, **kwargs)

    def facts(groups: dict) -> dict:
        out = {}
        for name, group in groups.items():
            if group is None:
                continue
            ones = torch.ones(1, device="cuda")
            dist.all_reduce(ones, group=group)
            backend = group._get_backend(torch.device("cuda"))
            out[name] = (members(group), backend.options._timeout, int(ones.item()))
        return out

    dist.split_group = split_group
    try:
        bound = dist.group.WORLD.bound_device_id is not None
        if world == 1:  # build_grid makes no group at world 1: split the world itself.
            return {"one": (bound, list(splits), facts({"g": distributed.new_groups([[0]])}))}
        out = {}
        for pp, dp, tp in GRID_LAYOUTS:
            del splits[:]
            grid = grid_lib.build_grid(pp, dp, tp, rank, world, pipe.embedding_group)
            groups = {name: getattr(grid, name) for name in NAMES}
            out[pp, dp, tp] = (bound, list(splits), facts(groups))
        return out
    finally:
        dist.split_group = real_split


@pytest.mark.parametrize("world", [1, 2])
def test_the_grid_splits_nccl_with_the_worlds_timeout(world):
    """Bound to a GPU (init_process_group's device_id), support/distributed.new_groups makes each dimension's
    groups in one dist.split_group, passing the world's timeout: every group's NCCL
    communicator holds GRID_TIMEOUT_S, not torch's 10 minutes, and sums over its ranks.
    At 2 ranks each layout's groups are tests/test_grid.py's formula's, one split a
    dimension (tp, dp, pp, and the embedding pairs at pp 2). tests/test_grid.py checks the
    same on gloo with split_group faked; this is NCCL's own word."""
    found = torch.cuda.device_count()
    if found < world:
        pytest.skip(f"needs {world} GPUs (NCCL runs one rank a GPU), found {found}")
    want_timeout = timedelta(seconds=GRID_TIMEOUT_S)
    results = run_ranks(_grid_on_nccl, world, init=False, timeout=180)
    for rank, res in enumerate(results):
        for layout, (bound, splits, groups) in res.items():
            assert bound, f"{layout}: the world is not bound to a GPU"
            assert splits and all(t == want_timeout for t in splits), f"{layout}: {splits}"
            for name, (ranks, timeout, total) in groups.items():
                assert timeout == want_timeout, f"{layout} {name}: {timeout}"
                assert total == len(ranks), f"{layout} {name}: summed {total} over {ranks}"
            if layout == "one":
                assert groups["g"][0] == [0], groups
                continue
            pp, dp, tp = layout
            want = expected_groups(rank, pp, dp, 1, tp)  # None: no group (cp, embed_group)
            got = {k: v[0] for k, v in groups.items()}
            assert got == {k: v for k, v in want.items() if v}, f"{layout}, rank {rank}"
            assert len(splits) == 3 + (pp > 1), f"{layout}: {len(splits)} world-wide calls"
