"""Checkpoints at cluster scale (issue 41): each distinct piece of state written once, ZeRO-3
saved from its shards without gathering, and a resume on another (dp, tp, pp, zero) layout.

One world of 4 ranks trains the sources once (module fixture `dp4`): dp 4 at ZeRO 0, 1 and 3,
and tp 2 x pp 2, 6 steps each with a checkpoint after step 2. The tests read its files, its
measurements, and resume its step-2 checkpoints on other layouts.
"""

import importlib
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from support.train import checkpoint
from support.train.command_line import parse_args
from tests.distributed import run_ranks
from tests.test_train import BASE, data_dir, metrics  # noqa: F401 (data_dir: a fixture)

train = importlib.import_module("train")
model_lib = importlib.import_module("02_model")
zero_lib = importlib.import_module("07_zero")

# 6 steps of 8 sequences (micro-batches of 2), a checkpoint after steps 2 and 5.
SOURCE = ["--max-steps", "6", "--micro-batch-size", "2", "--ckpt-interval", "3",
          "--keep-checkpoints", "3"]  # fmt: skip
SOURCES = {
    "dp4-zero0": ["--dp", "4"],
    "dp4-zero1": ["--dp", "4", "--zero", "1"],
    "dp4-zero3": ["--dp", "4", "--zero", "3"],
    "tp2-pp2": ["--tp", "2", "--pp", "2"],
}


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors created inside (views of an input not counted), alive at
    once at the worst moment: `peak`. A tensor counts until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                size = t.untyped_storage().nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self.freed, size)
        return out

    def freed(self, size: int) -> None:
        self.live -= size


def _sources(rank, world, data_path, tmp):
    """Train every source layout; measure the ZeRO-3 save of step 2. Returns, per rank, the
    ZeRO-3 save's (peak new bytes, all-gather bytes, this rank's shard elements, the largest
    unit's elements)."""
    real = checkpoint.shard_of
    measured = {}

    def measuring(run, step):
        before = run.optimizer.stats["all_gather_bytes"]
        with LiveBytes() as mode:
            shard = real(run, step)
        gathered = run.optimizer.stats["all_gather_bytes"] - before
        shard_numel = sum(f.S for f in run.optimizer.flats)
        units = zero_lib.zero_units(run.modules()[0])
        done = set()
        unit_numel = []
        for u in units:  # a unit's own weights: its parameters less earlier units'
            own = [p for p in u.parameters() if p not in done]
            done.update(own)
            unit_numel.append(sum(p.numel() for p in own))
        measured.setdefault(step, (mode.peak, gathered, shard_numel, max(unit_numel)))
        return shard

    for name, flags in SOURCES.items():
        checkpoint.shard_of = measuring if name == "dp4-zero3" else real
        try:
            out_dir = f"{tmp}/{name}"
            train.main(BASE + SOURCE + flags + ["--data-dir", data_path, "--out-dir", out_dir])
        finally:
            checkpoint.shard_of = real
        dist.barrier()
    return measured[2]


@pytest.fixture(scope="module")
def dp4(data_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("sources")
    measured = run_ranks(_sources, 4, data_dir, str(tmp), timeout=600)
    return tmp, measured


def psi(tp: int = 1) -> int:
    """The tiny GPT's parameter count Ψ (BASE: 4 blocks of C = 32, 257 characters padded to
    64·tp rows), counted from 02's model, not from a checkpoint."""
    config = model_lib.GPTConfig.from_preset("tiny", n_layer=4, vocab_size=257,
                                             pad_vocab_multiple=64 * tp)  # fmt: skip
    return sum(p.numel() for p in model_lib.GPT(config).parameters())  # wte once (tied)


def file_bytes(ckpt: Path) -> tuple[int, int, list]:
    """(bytes of the rank files on disk, bytes of the tensors they hold, pieces per file)."""
    files = sorted(ckpt.glob("rank_*.pt"))
    disk = sum(f.stat().st_size for f in files)
    shards = [torch.load(f, weights_only=True) for f in files]
    tensors = sum(p["tensor"].nbytes for s in shards for p in s["pieces"])
    return disk, tensors, [len(s["pieces"]) for s in shards]


@pytest.mark.parametrize("name", ["dp4-zero0", "dp4-zero1", "dp4-zero3"])
def test_a_dp4_save_writes_the_distinct_state_once(dp4, name):
    """The state of Ψ fp32 weights and AdamW's two fp32 moments is 12Ψ bytes, whatever dp
    holds it. Each file also holds its rank's RNG streams (torch's: 5,056 bytes), the
    pieces' index (name, shape, slice: ~100 bytes each) and zip headers (~64 bytes a
    tensor): under 64 KiB a file here. Before, every DP rank wrote the whole model and, at
    ZeRO 0, the whole AdamW state: 4 x 12Ψ at dp 4."""
    tmp, _ = dp4
    ckpt = tmp / name / "checkpoints" / "step_0000002"
    disk, tensors, pieces = file_bytes(ckpt)
    distinct = 12 * psi()
    assert tensors == distinct, f"{name}: tensors {tensors:,} B, distinct 12Ψ = {distinct:,} B"
    overhead = disk - distinct
    assert 0 < overhead < 4 * 64 * 1024, f"{name}: {disk:,} B on disk, 12Ψ = {distinct:,} B"
    assert all(n > 0 for n in pieces), pieces  # ZeRO: its shards; ZeRO 0: its share (below)
    if name == "dp4-zero0":  # the 4 replicas share the writing: the 3Ψ elements (weights
        # and two moments) cut in 4 ranges of ⌈3Ψ/4⌉, as 07 cuts a flat: a quarter each.
        quarter = 4 * -(-3 * psi() // 4)  # fp32 bytes
        files = sorted(ckpt.glob("rank_*.pt"))
        mine = [sum(p["tensor"].nbytes for p in torch.load(f, weights_only=True)["pieces"])
                for f in files]  # fmt: skip
        assert mine[:-1] == [quarter] * 3 and mine[-1] == distinct - 3 * quarter, (mine, quarter)


def test_a_tp2_pp2_save_writes_each_cut_once(dp4):
    """At tp 2 x pp 2 every rank holds distinct state (a stage's TP cut): 12Ψ in all, with
    Ψ at tp 2's padding (64·2 rows), the last stage's copy of the tied wte not written."""
    tmp, _ = dp4
    _, tensors, pieces = file_bytes(tmp / "tp2-pp2" / "checkpoints" / "step_0000002")
    assert tensors == 12 * psi(tp=2), (tensors, 12 * psi(tp=2))
    assert all(n > 0 for n in pieces), pieces


def test_zero3_saves_its_shards_without_gathering(dp4):
    """No all-gather during a ZeRO-3 save, and the tensors it makes alive at once (its
    pieces' CPU copies) stay under this rank's shard of the weights and AdamW's moments
    plus one unit's weights: 12·S + 4·U bytes (S: the rank's shard elements, Σ⌈n_f/N⌉
    over its flats; U: the largest unit's). Before, every rank gathered every unit (4Ψ)
    and DP rank 0 copied the whole model to the CPU (4Ψ more)."""
    _, measured = dp4
    for rank, (peak, gathered, S, U) in enumerate(measured):
        bound = 12 * S + 4 * U
        what = f"rank {rank}: peak {peak:,} B new during the save, 12·S + 4·U = {bound:,} B"
        assert 0 < peak <= bound, what
        assert peak < 4 * psi(), what  # below a gathered model, however units are cut
        assert gathered == 0, f"rank {rank} all-gathered {gathered:,} B while saving"


def test_export_assembles_the_model_from_zero3_shards(dp4):
    """model.pt of the ZeRO-3 run (its weights assembled from 4 ranks' flat pieces) equals
    the dp 4 ZeRO-0 run's (written whole by DP rank 0) to fp32 rounding: the same 6 steps,
    reduced in another order (4 AdamW steps keep that below 1e-4, see test_train)."""
    tmp, _ = dp4
    zero3 = torch.load(tmp / "dp4-zero3" / "model.pt", weights_only=True)["model"]
    zero0 = torch.load(tmp / "dp4-zero0" / "model.pt", weights_only=True)["model"]
    assert zero3.keys() == zero0.keys()
    for key, value in zero0.items():
        torch.testing.assert_close(zero3[key], value, rtol=1e-4, atol=1e-5, msg=key)


# ---------------------------------------------------------------------------------------------
# Resume on another layout
# ---------------------------------------------------------------------------------------------
# Ops that read only a tensor's shape and dtype, not its bytes (x.new_empty(n) and the like).
NO_READ = {"new_empty", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like",
           "ones_like", "full_like"}  # fmt: skip


class ReadBytes(TorchDispatchMode):
    """The bytes read from checkpoint files (storages torch.load returned: memory-mapped,
    so their bytes are read only when an op takes them): each op that is not a view (and
    not in NO_READ) counts the elements of its inputs that live in one of those storages."""

    def __init__(self, storages: set):
        super().__init__()
        self.storages = storages
        self.read = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._schema.name.split("::")[-1] not in NO_READ:
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages:
                    self.read += a.numel() * a.element_size()
        return func(*args, **(kwargs or {}))


def _resume(rank, world, data_path, tmp, source, flags):
    """Step 2's checkpoint of `source`, copied into a new folder, resumed there at `flags`'s
    layout for steps 3..5. Returns, per rank, rank 0's train rows and folder, and what this
    rank read to resume: the checkpoint files it opened (torch.load, wrapped), the bytes its
    restore copied out of them (ReadBytes), and what its layout holds (reads_needed)."""
    out = Path(tmp) / f"{source}-to-{'-'.join(f.strip('-') for f in flags)}"
    if rank == 0:
        src = Path(tmp) / source / "checkpoints" / "step_0000002"
        shutil.copytree(src, out / "checkpoints" / src.name)
    if dist.is_initialized():
        dist.barrier()
    opened = []
    storages = set()
    real_load = torch.load
    real_restore = checkpoint.restore
    seen = {}

    def counting_load(path, *args, **kwargs):
        data = real_load(path, *args, **kwargs)
        if "step_0000002" in str(path):  # the resumed checkpoint's files, not model.pt's
            opened.append(Path(path).name)
            for t in torch.utils._pytree.tree_leaves(data):
                if isinstance(t, torch.Tensor):
                    storages.add(t.untyped_storage().data_ptr())
        return data

    def counting_restore(run, shard):
        with ReadBytes(storages) as mode, LiveBytes() as live:
            then = real_restore(run, shard)
        seen["read"] = mode.read
        seen["needed"] = {**reads_needed(run), "peak": live.peak}
        return then

    torch.load = counting_load
    checkpoint.restore = counting_restore
    try:
        train.main(BASE + SOURCE + flags + ["--data-dir", data_path, "--out-dir", str(out),
                                            "--resume"])  # fmt: skip
    finally:
        torch.load = real_load
        checkpoint.restore = real_restore
    if dist.is_initialized():
        dist.barrier()
    rows = (metrics(out), str(out)) if rank == 0 else None
    return rows, sorted(opened), seen["read"], seen["needed"]


V_SAVED = 320  # the sources' wte rows in the checkpoints: 257 padded to 64 (dp 4) ...
ROWS_TP2 = 384  # ... or to 64·2 at tp 2 (tp2-pp2): rows past 320 are zero padding


def reads_needed(run) -> dict:
    """What a resumed rank must read, from its own layout alone (not from the checkpoint
    code): the elements it holds x 12 bytes (an fp32 weight and AdamW's two fp32 moments),
    and, where the source was dp 4 ZeRO (its files are its 4 ranks' flat shards), the files
    those elements are in. 07 cuts a flat of n elements into N shards of S = ⌈n/N⌉: rank r
    holds [r·S, (r+1)·S) ∩ [0, n). So at ZeRO, this rank's [lo, lo + S_new) of each flat is in
    the old ranks r whose [r·⌈n/4⌉, (r+1)·⌈n/4⌉) meets it, and without ZeRO it holds its
    parameters whole (its TP cut: wte's rows past the checkpoint's 320 are padding, zero, and
    in no file)."""
    if run.cfg.zero:
        files = set()
        elements = 0
        held = sum(f.S for f in run.optimizer.flats)  # its shards' elements, padding too
        for f in run.optimizer.flats:
            n = sum(f.numels)
            hi = min(f.lo + f.S, n)
            elements += max(0, hi - f.lo)
            old = -(-n // 4)  # ⌈n/4⌉
            files.update(r for r in range(4) if max(f.lo, r * old) < min(hi, (r + 1) * old))
        return {"bytes": 12 * elements, "files": sorted(files), "held": held}
    elements = 0
    held = sum(p.numel() for m in run.modules() for p in m.parameters())
    tp_rank = run.grid.tp_rank
    for module in run.modules():
        for name, p in module.named_parameters():
            rows = p.size(0)
            if name in ("transformer.wte.weight", "lm_head.weight"):  # (V/tp, C), rows cut
                rows = min(rows, max(0, V_SAVED - tp_rank * rows))
            elements += rows * (p.numel() // p.size(0))
    whole = run.grid.tp == 1 and run.grid.pp == 1  # the whole model: every source file
    return {"bytes": 12 * elements, "files": list(range(4)) if whole else None, "held": held}


def windows(step: int, dp: int, data_path) -> list:
    """The training windows all DP ranks of a dp-rank run read at `step`, in rank order."""
    data = importlib.import_module("01_data")
    loaders = [data.DataLoader(data_path, "train", 8 // dp, 32, 1337, r, dp) for r in range(dp)]
    return [int(w) for loader in loaders for w in loader.window_ids(step)]


@pytest.mark.parametrize(
    "source, world, flags, old_dp, new_dp",
    [("dp4-zero1", 2, ["--dp", "2", "--zero", "1"], 4, 2),
     ("tp2-pp2", 4, ["--dp", "4"], 1, 4),
     ("dp4-zero3", 1, [], 4, 1),
     ("dp4-zero3", 2, ["--dp", "2", "--zero", "3"], 4, 2),
     ("dp4-zero1", 4, ["--tp", "2", "--pp", "2"], 4, 1)],
    ids=["dp4-zero1-to-dp2", "tp2-pp2-to-dp4", "dp4-zero3-to-dp1-zero0", "dp4-zero3-to-dp2",
         "dp4-zero1-to-tp2-pp2"],
)  # fmt: skip
def test_resume_on_another_layout_continues_as_that_layout_would(dp4, data_dir, source,  # noqa: F811
                                                                 world, flags, old_dp, new_dp):
    """The source ran 6 steps; its step-2 checkpoint resumed on another layout runs steps
    3..5. Same weights, AdamW state, step and data position: the losses, gradient norms
    and final weights equal the source's to fp32 rounding (both layouts equal one process
    to rounding; 3 AdamW steps keep that below 1e-4 relative on a loss of ~5, test_train's
    tolerance). Moments lost on the way, or a batch skipped, are off by far more: the loss
    equality is what proves the resumed run read the source's batches (its data position).
    The windows check at the end proves less: that 01's loader, by itself, deals each step's
    global batch alike at the old dp and the new (its windows are a function of (seed,
    step), not of dp), so the new layout CAN read the source's batches; it reads no batch
    the resumed run took.

    What each rank read to resume: exactly the bytes of the slices it holds (reads_needed:
    12 bytes an element it holds), and only the files that hold them (where reads_needed
    derives them), holding no more than the state it keeps. Before, every rank opened every
    file and copied every piece of each tensor it needed whole (at dp 4 ZeRO-1 -> dp 2: 4
    files and 527,232 B on rank 0, not 372,864 B = 12Ψ/2)."""
    tmp, _ = dp4
    if world == 1:
        ranks = [_resume(0, 1, data_dir, str(tmp), source, flags)]
    else:
        ranks = run_ranks(_resume, world, data_dir, str(tmp), source, flags, timeout=300)
    (resumed, out), *_ = ranks[0]
    straight = metrics(tmp / source)
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for key in ("loss", "grad_norm"):
        got = torch.tensor([r[key] for r in resumed])
        want = torch.tensor([r[key] for r in straight[3:]])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    mine = torch.load(Path(out) / "model.pt", weights_only=True)["model"]
    theirs = torch.load(tmp / source / "model.pt", weights_only=True)["model"]
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-5, msg=key)
    # 01's loader alone (see above): the resumed run's batches are proven by the losses.
    for step in (3, 4, 5):
        assert windows(step, new_dp, data_dir) == windows(step, old_dp, data_dir), step
    for rank, (_, opened, read, needed) in enumerate(ranks):
        what = f"rank {rank}: opened {opened}, read {read:,} B; needed {needed}"
        print(what)
        assert read == needed["bytes"], what
        files = [checkpoint.shard_name(r) for r in needed["files"] or []]
        assert opened == files or needed["files"] is None, what
        assert len(opened) == len(set(opened)) <= 4, what  # each file opened once at most
        # The restore's new tensors alive at once: AdamW's two fp32 moments of what it holds,
        # which it keeps (8 bytes an element), and a 4-byte step count per parameter or shard
        # (under 4 KiB here): each slice is copied into place, nothing assembled. Before,
        # each tensor was rebuilt whole beside them (a byte mask, a merge, a cut copy).
        bound = 8 * needed["held"] + 4096
        assert 0 < needed["peak"] <= bound, f"{what}: peak {needed['peak']:,} B > {bound:,} B"
    # Every element of the model's state is held by one rank of a ZeRO layout: 12Ψ in all.
    if "--zero" in flags:
        assert sum(r[2] for r in ranks) == 12 * psi()


def test_resume_refuses_other_token_files_in_one_line(dp4, data_dir, tmp_path):  # noqa: F811
    """The checkpoint records its token files' fingerprint: a --data-dir whose files differ
    (here one token changed in the middle of the train shard's last MiB) is one line."""
    tmp, _ = dp4
    other = tmp_path / "data"
    shutil.copytree(data_dir, other)
    shard = other / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 1
    shard.write_bytes(bytes(raw))
    out = tmp_path / "run"
    shutil.copytree(tmp / "dp4-zero3" / "checkpoints", out / "checkpoints")
    argv = BASE + SOURCE + ["--out-dir", str(out), "--resume"]
    cfg, _ = parse_args(argv + ["--data-dir", data_dir])
    checkpoint.check_resume_layout(cfg)  # its own data: fine, on another layout too
    cfg, _ = parse_args(argv + ["--data-dir", str(other)])
    with pytest.raises(train.ConfigError) as err:
        checkpoint.check_resume_layout(cfg)
    message = str(err.value)
    assert "holds other token files" in message and "\n" not in message, message


def test_a_checkpoint_from_before_the_pieces_stops_in_one_line(data_dir, tmp_path):  # noqa: F811
    """A checkpoint whose meta.json lists no pieces (written before the slice index) is no
    damage to fall back from: read as one, --resume found no readable checkpoint and started
    at step 0."""
    argv = BASE + ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--max-steps", "1"]
    train.main(argv)
    meta = checkpoint.complete_checkpoints(tmp_path)[0] / "meta.json"
    old = json.loads(meta.read_text())
    del old["pieces"]
    meta.write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="does not fit this run"):
        train.main(argv[:-1] + ["2", "--resume"])
