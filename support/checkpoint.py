"""Checkpoint files (a folder per step, a shard per rank) and the ranks' votes on them.

OUT/checkpoints/step_0000042/ holds rank_00000.pt, rank_00001.pt, ... and meta.json. A
save writes into step_N.partial/ and renames it only once every shard and meta.json are
on disk, so a folder without the suffix is complete: a crash leaves a .partial folder,
never a torn checkpoint. The last K complete ones are kept.

Loading needs every rank to agree on one checkpoint: rank 0's listing is shared, each
rank votes whether its shard reads (MIN: all must), and a damaged newest checkpoint
falls back to the previous one on all ranks together. A preemption signal to any rank
stops all ranks at the same step (MAX). A shard holds all that a train.Run needs to go
on bit for bit (shard_of, restore); this file reads the Run's parts, never a lesson.
"""

import contextlib
import json
import os
import shutil
import signal
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from support.config import ConfigError, TrainConfig, flag_name
from support.distributed import print0
from support.files import atomic_write, fsync_dir

# The flags that fix a checkpoint's shards (found by global rank, shaped by ZeRO and the
# virtual stages) and its batches (the seed and the batch's shape): a resume keeps them.
LAYOUT_FLAGS = (
    "dp",
    "tp",
    "pp",
    "cp",
    "virtual_stages",
    "zero",
    "seed",
    "batch_size",
    "micro_batch_size",
    "block_size",
    "grad_compression",
    "powersgd_rank",
    "lora_rank",
    "lora_alpha",
)


def ckpt_root(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def complete_checkpoints(out_dir) -> list[Path]:
    """The complete checkpoints, newest first: renamed from .partial, with meta.json."""
    found = ckpt_root(out_dir).glob("step_*")
    done = [d for d in found if not d.name.endswith(".partial")]
    return sorted((d for d in done if (d / "meta.json").is_file()), reverse=True)


def remove_partials(out_dir) -> None:
    """A save killed midway leaves step_N.partial/, never to be completed: remove it."""
    for stale in ckpt_root(out_dir).glob("*.partial"):
        shutil.rmtree(stale, ignore_errors=True)


def check_out_dir(cfg: TrainConfig) -> None:
    """Never mix two runs in one folder: --resume continues the run it finds there, with
    the same layout; a fresh run refuses a folder that holds checkpoints."""
    if cfg.resume:
        check_resume_layout(cfg)
        return
    ckpts = complete_checkpoints(cfg.out_dir)
    if ckpts:
        fix = "pass --resume to continue that run, or another --out-dir"
        where = f"--out-dir {cfg.out_dir} already holds checkpoints"
        raise ConfigError(f"{where} (newest: {ckpts[0].name}): {fix}")


def check_resume_layout(cfg: TrainConfig) -> None:
    """--resume continues the newest readable checkpoint with its LAYOUT_FLAGS."""
    for ckpt in complete_checkpoints(cfg.out_dir):
        try:
            saved = json.loads((ckpt / "meta.json").read_text())["config"]
        except (OSError, ValueError, KeyError):
            continue  # A damaged meta.json: load_newest names it and falls back too.
        # A flag newer than the checkpoint takes its default.
        saved = {**asdict(TrainConfig()), **saved}
        for key in LAYOUT_FLAGS:
            if saved[key] == getattr(cfg, key):
                continue
            name = flag_name(key)
            now = getattr(cfg, key)
            was = f"{ckpt} was written with {name} {saved[key]}"
            was += f", this run has {name} {now}"
            fix = f"resume with the same {name} (or a new --out-dir)"
            raise ConfigError(f"--resume: {was}; {fix}")
        return  # Only the newest readable checkpoint counts; none: a fresh start.


def agree(value: float, op, world: int, device) -> float:
    """`value` reduced over all ranks (MIN: all are ok; MAX: any one asks).

    The tensor lives on `device`, as NCCL needs. A world of one has no one to ask (and
    its device may hold no data: the tests' "meta" device).
    """
    if world == 1:
        return value
    t = torch.tensor(value, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def tokenizer_name(data_dir) -> str:
    """The tokenizer of --data-dir's meta.json, as export needs it from any folder.

    A name ("gpt2", "char") stays a name; a saved BPE's path is made absolute.
    """
    tokenizer = json.loads((Path(data_dir) / "meta.json").read_text())["tokenizer"]
    if tokenizer in ("gpt2", "char"):
        return tokenizer
    return str(Path(tokenizer).resolve())


def save(
    out_dir, step: int, rank: int, world: int, device, shard: dict, meta, keep: int
):
    """Every rank writes its shard into step_N.partial/; rank 0 adds meta.json, renames
    the folder to step_N and keeps the newest `keep`. `meta()` builds meta.json's
    contents (rank 0, once every shard is written).

    Each of the three parts ends in a vote, not a barrier: a rank that failed (a full
    disk, a data folder gone for meta()) says so, and every rank raises at once. Behind
    a barrier the others would wait out the collective's timeout. The checkpoint before
    stays whole; the next start removes the .partial folder.
    """
    root = ckpt_root(out_dir)
    final = root / f"step_{step:07d}"
    partial = root / f"step_{step:07d}.partial"

    def empty_folder():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def publish():
        text = json.dumps({"step": step, **meta()}, indent=1)
        atomic_write(partial / "meta.json", lambda tmp: tmp.write_text(text))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # Every shard's name is on disk already.
        fsync_dir(root)  # The rename itself.
        for old in complete_checkpoints(out_dir)[keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def write_shard():
        atomic_write(partial / shard_name(rank), lambda tmp: torch.save(shard, tmp))

    for part in (empty_folder, write_shard, publish):
        mine = part if part is write_shard or rank == 0 else None
        all_or_none(mine, f"saving step {step}", world, device)


def all_or_none(action, what: str, world: int, device) -> None:
    """Run action (None: nothing on this rank), then vote: if it raised on any rank,
    every rank raises (this one its own error), so none waits in a later collective."""
    error = None
    if action is not None:
        try:
            action()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or hang.
            error = e
            # Said now, before the vote, which may fail too (a peer gone, a timeout).
            rank = dist.get_rank() if world > 1 else 0
            print(f"[rank {rank}] {what}: {type(e).__name__}: {e}", flush=True)
    if agree(0.0 if error else 1.0, dist.ReduceOp.MIN, world, device) < 1.0:
        if error is not None:
            raise error
        raise RuntimeError(f"{what} failed on another rank (its error is above)")


def load_newest(out_dir, rank: int, world: int, device, restore) -> dict | None:
    """The newest checkpoint every rank can read, restored by `restore(shard)`.

    A file that cannot be read is named and the previous checkpoint tried, all ranks
    agreeing. A shard that reads but does not fit (`restore` raises: another model) is
    no damage to fall back from: every rank hears of it and the run stops. `restore`
    runs no collective (a rank that raised would miss it: a hang); what it returns, if
    anything, runs on every rank after the vote. Shards load to the CPU, since RNG
    states must stay CPU tensors. Returns the shard, or None.
    """
    names = [[d.name for d in complete_checkpoints(out_dir)]]
    if world > 1:
        # Rank 0's listing for all: a node with a stale view of a shared filesystem must
        # not vote on another list (a hang).
        dist.broadcast_object_list(names, src=0)
    who = f"[rank {rank}]"
    for name in names[0]:
        ckpt = ckpt_root(out_dir) / name
        path = ckpt / "meta.json"
        try:
            json.loads(path.read_text())["step"]  # Export and the layout check read it.
            path = ckpt / shard_name(rank)
            shard = torch.load(path, map_location="cpu", weights_only=True)
            ok = 1.0
        except Exception as e:  # noqa: BLE001 - any unreadable file: name it, go on.
            error = f"{type(e).__name__}: {str(e)[:120]}"
            what = f"{who} checkpoint file {path} is unreadable ({error})"
            print(f"{what}; trying the previous one")
            ok = 0.0
        if agree(ok, dist.ReduceOp.MIN, world, device) < 1.0:
            continue
        then = None
        try:
            then = restore(shard)
        except Exception as e:  # noqa: BLE001 - all ranks must hear of it, or hang.
            print(f"{who} {path} does not fit this run: {str(e)[:200]}")
            ok = 0.0
        if agree(ok, dist.ReduceOp.MIN, world, device) < 1.0:
            raise SystemExit(
                f"--resume: {ckpt} does not fit this run on some rank (above)"
            )
        if then is not None:  # Every rank: the vote said all fit.
            then()
        print0(f"resumed from {ckpt} (step {shard['step']})")
        return shard
    print0(f"--resume: no readable checkpoint in {ckpt_root(out_dir)}: from step 0")
    return None


def powersgd_states(chunks) -> list:
    """The PowerSGD state objects (Q and the residuals) of 03's DataParallel chunks."""
    hooks = [getattr(c, "comm_hook", None) for c in chunks]
    return [h for h in hooks if hasattr(h, "state_dict")]  # PowerSGD: the stateful hook


def shard_of(run, step: int) -> dict:
    """This rank's shard of a train.Run: its model chunks' weights, the optimizer, the
    loss scaler, the RNG streams, PowerSGD's state, the step and the config.

    Dropout's generators are saved: the default one (and CUDA's), and 04's per-rank
    tracker. Python's and NumPy's go unused (01's loader has its own). ZeRO-3 holds 1/N
    of each weight: each chunk is gathered, and DP rank 0 (CP rank 0: the CP ranks hold
    copies) keeps a CPU copy for --export
    (a resume reads the optimizer's shards instead).
    """
    cfg = run.cfg
    rng = {"torch": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    tp_rng = getattr(run.modules()[0], "tp_rng", None)
    models = []
    for chunk, module in zip(run.chunks, run.modules()):
        gather = chunk.gathered() if cfg.zero == 3 else contextlib.nullcontext()
        with gather:
            state = module.state_dict()
            first = run.grid.dp_rank == 0 and run.grid.cp_rank == 0
            if cfg.zero == 3 and first:
                state = {k: v.to("cpu", copy=True) for k, v in state.items()}
            elif cfg.zero == 3:
                state = {}
            models.append(state)
    shard = {"model": models, "optimizer": run.optimizer.state_dict()}
    shard["scaler"] = run.scaler.state_dict()
    shard["rng"] = rng
    shard["tp_rng"] = None if tp_rng is None else tp_rng.state_dict()
    shard["powersgd"] = [p.state_dict() for p in powersgd_states(run.chunks)]
    shard["step"] = step  # The data position too: batches are a function of the step.
    shard["data_position"] = list(run.train.position(step))
    shard["config"] = asdict(cfg)
    return shard


def restore(run, shard: dict):
    """A shard back into a train.Run, with no collective; raises if it does not fit
    (another model). Returns what is left for every rank to run once all agree that it
    fits: ZeRO-1/2's all-gather of the weights, or None."""
    for module, state in zip(run.modules(), shard["model"], strict=True):
        if run.cfg.zero < 3:  # ZeRO-3: the optimizer's shards are the weights.
            # Copies into the parameters, on their device.
            module.load_state_dict(state)
    if run.cfg.zero:  # The all-gather after the vote: a rank that raised skips it.
        run.optimizer.load_state_dict(shard["optimizer"], gather=False)
    else:  # To each parameter's device.
        run.optimizer.load_state_dict(shard["optimizer"])
    if shard["scaler"]:
        run.scaler.load_state_dict(shard["scaler"])
    states = powersgd_states(run.chunks)
    for p, state in zip(states, shard.get("powersgd", []), strict=True):
        p.load_state_dict(state)
    if shard["tp_rng"] is not None:
        run.modules()[0].tp_rng.load_state_dict(shard["tp_rng"])
    torch.set_rng_state(shard["rng"]["torch"])
    if "cuda" in shard["rng"]:
        torch.cuda.set_rng_state(shard["rng"]["cuda"], run.device)
    return run.optimizer.gather_weights if run.cfg.zero else None


def save_checkpoint(run, step: int) -> None:
    """Save a train.Run at `step`: every rank's shard, and rank 0's meta.json."""
    cfg = run.cfg
    grid = run.grid

    def meta():  # Rank 0's, once the shards are written (see save).
        fields = {"world": grid.world, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}
        fields["cp"] = cfg.cp  # Export reads the shards of grid (p, 0, 0, t).
        fields["model_config"] = asdict(run.gpt_config)
        fields["tokenizer"] = tokenizer_name(cfg.data_dir)
        fields["config"] = asdict(cfg)
        return fields

    shard = shard_of(run, step)
    keep = cfg.keep_checkpoints
    save(cfg.out_dir, step, grid.rank, grid.world, run.device, shard, meta, keep)


def load_checkpoint(run) -> int:
    """Restore a train.Run from the newest checkpoint every rank can read (load_newest);
    returns the step to continue from (0: none)."""
    grid = run.grid
    out_dir = run.cfg.out_dir
    shard = load_newest(
        out_dir, grid.rank, grid.world, run.device, partial(restore, run)
    )
    return 0 if shard is None else shard["step"] + 1


def read_newest(run_dir, read):
    """`read(ckpt)` of the newest complete checkpoint it succeeds on, for --export.

    A damaged checkpoint (meta.json or a shard) is named and the previous one used, as
    --resume does.
    """
    for ckpt in complete_checkpoints(run_dir):
        try:
            return read(ckpt)
        except Exception as e:  # noqa: BLE001 - any unreadable file: name it, go on.
            error = f"{type(e).__name__}: {str(e)[:120]}"
            what = f"--export: {ckpt} is unreadable ({error})"
            print(f"{what}; trying the previous checkpoint")
    raise SystemExit(
        f"--export: no complete, readable checkpoint in {ckpt_root(run_dir)}"
    )


VOTE_SECONDS = 10.0  # Votes at most ~this far apart (and --vote-interval steps).


class Preemption:
    """SIGTERM and SIGUSR1 (Slurm's warning, a spot instance going away) set a flag, and
    the ranks vote on it (MAX), so a signal to any one of them stops all at one step.

    A vote is an all-reduce and a host sync, so a plain step has none: `at(step)` votes
    only at steps every rank agreed on. The first is after the first step (which may
    compile for minutes); each vote also agrees (MIN) on the gap to the next, at most
    `max_gap` steps and as many as fit in VOTE_SECONDS at the step time each rank
    measured since the last vote. At 0.1 s a step: every 10 steps; at minutes a step
    (a long-context run): every step. A world of one asks itself every step, for free.
    """

    def __init__(self, world: int, device, max_gap: int):
        self.signals = []
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: self.signals.append(signum))
        self.world = world
        self.device = device
        self.max_gap = max_gap
        self.start_at(0)

    def start_at(self, step: int) -> None:
        """The first vote after `step`, the run's first (a resume's too)."""
        self.next_vote = step
        self.last = (time.perf_counter(), step - 1)  # The last vote's time and step.

    def asked(self) -> bool:
        """A collective: was any rank signalled? (Evaluation asks before each batch.)"""
        flag = float(bool(self.signals))
        return bool(agree(flag, dist.ReduceOp.MAX, self.world, self.device))

    def at(self, step: int) -> bool:
        """After `step`: True if the ranks agree a signal came (at a vote step only)."""
        if self.world == 1:
            return bool(self.signals)
        if step != self.next_vote:
            return False
        # subtle: made before the clock is read. On a GPU this copy waits for the steps
        # queued so far, so the time is theirs, not the host's time to queue them.
        mine = torch.tensor([float(bool(self.signals)), 0.0], device=self.device)
        now = time.perf_counter()
        per_step = max((now - self.last[0]) / (step - self.last[1]), 1e-9)  # Never 0.
        gap = max(1, min(self.max_gap, int(VOTE_SECONDS / per_step)))
        mine[1] = -gap  # On the device: no second wait.
        # One all-reduce, MAX of [signalled, -gap]: any rank's signal, the smallest gap.
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        signalled, neg_gap = mine.tolist()
        self.last = (now, step)
        self.next_vote = step + int(-neg_gap)
        return signalled > 0
