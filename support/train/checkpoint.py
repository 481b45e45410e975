"""Checkpoint files (a folder per step, a file per rank) and the ranks' votes on them.

OUT/checkpoints/step_0000042/ holds rank_00000.pt, rank_00001.pt, ... and meta.json. A
save writes into step_N.partial/ and renames it only once every file and meta.json are
on disk, so a folder without the suffix is complete: a crash leaves a .partial folder,
never a torn checkpoint. The last K complete ones are kept.

Each distinct piece of state is written once. Weights and AdamW's moments that DP and
CP replicas hold alike are spread over them, a share to an element each (spread); under
ZeRO each rank writes the pieces of its own shards (ZeRO-3 without gathering a weight).
Every piece is described by its global name, global shape and the slice it holds: its
TP cut (dim, chunks, tp rank, tp) and a range of that cut, flattened. meta.json lists
every file's pieces (rank 0 reads them back from the files), with what all ranks hold
alike: the step, the data position, the config, the scaler, AdamW's hyperparameters and
step counts.
Loading reads meta.json, opens only the files that hold a piece overlapping a slice
this rank holds in its own layout, and copies only the overlap, rectangle by
rectangle: a run resumes on another (dp, tp, pp, cp, zero). Every rank's file also
holds its RNG streams and PowerSGD's state, read back on the same layout only.

Loading needs every rank to agree on one checkpoint: rank 0's listing is shared, each
rank votes whether the files read (MIN: all must), and a damaged newest checkpoint
falls back to the previous one on all ranks together. A preemption signal to any rank
stops all ranks at the same step (MAX). This file reads a train.Run's parts, never a
lesson.
"""

import hashlib
import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from support.distributed import print0
from support.files import atomic_write, fsync_dir
from support.plan.shape import SHAPE
from support.tensor_parallel import sharding
from support.train import vocab
from support.train.config import ConfigError, TrainConfig, flag_name

# The flags a resume keeps: the batches (the seed and the batch's shape), PowerSGD's and
# LoRA's state. The layout (RESHARDED) may change: loading cuts the pieces anew.
LAYOUT_FLAGS = (
    "seed",
    "batch_size",
    "micro_batch_size",
    "block_size",
    "grad_compression",
    "powersgd_rank",
    "lora_rank",
    "lora_alpha",
)
RESHARDED = ("dp", "tp", "pp", "cp", "virtual_stages", "zero")


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


def check_resume_shape(cfg: TrainConfig, gpt_config) -> None:
    """--resume: the newest readable checkpoint holds a model of `gpt_config`'s shape
    (meta.json's model_config), else one line naming the flags that differ, before any
    process group exists (its shards would not fit the model: a vote, after the start).
    The vocabulary is the data's unless --vocab-size says."""
    for ckpt in complete_checkpoints(cfg.out_dir) if cfg.resume else []:
        try:
            saved = json.loads((ckpt / "meta.json").read_text())["model_config"]
        except (OSError, ValueError, KeyError):
            continue  # Damaged: load_newest names it and falls back, as check_out_dir.
        differ = [k for k in SHAPE if saved[k] != getattr(gpt_config, k)]
        was = ", ".join(f"{flag_name(k)} {saved[k]}" for k in differ)
        now = ", ".join(f"{flag_name(k)} {getattr(gpt_config, k)}" for k in differ)
        if differ:
            fix = "resume with the same --model and shape flags (or a new --out-dir)"
            raise ConfigError(f"--resume: {ckpt} holds {was}, this run {now}: {fix}")
        return  # Only the newest readable checkpoint counts.


def check_resume_layout(cfg: TrainConfig) -> None:
    """--resume continues the newest readable checkpoint with its LAYOUT_FLAGS and its
    token files (if it records their fingerprint), on any layout; PowerSGD's per-rank
    state, on its own layout only."""
    for ckpt in complete_checkpoints(cfg.out_dir):
        try:
            meta = json.loads((ckpt / "meta.json").read_text())
            saved = meta["config"]
        except (OSError, ValueError, KeyError):
            continue  # A damaged meta.json: load_newest names it and falls back too.
        # A flag newer than the checkpoint takes its default.
        saved = {**asdict(TrainConfig()), **saved}
        keys = LAYOUT_FLAGS
        if cfg.grad_compression == "powersgd":  # Q and residuals: one per rank
            keys = (*RESHARDED, *LAYOUT_FLAGS)
        for key in keys:
            if saved[key] == getattr(cfg, key):
                continue
            name = flag_name(key)
            now = getattr(cfg, key)
            was = f"{ckpt} was written with {name} {saved[key]}"
            was += f", this run has {name} {now}"
            fix = f"resume with the same {name} (or a new --out-dir)"
            raise ConfigError(f"--resume: {was}; {fix}")
        was = meta.get("data_fingerprint")
        now = data_fingerprint(cfg.data_dir) if was else None
        if was and now != was:
            where = f"--data-dir {cfg.data_dir} holds other token files"
            fix = "resume with the data it trained on (or a new --out-dir)"
            raise ConfigError(f"--resume: {where} than {ckpt} trained on: {fix}")
        return  # Only the newest readable checkpoint counts; none: a fresh start.


def data_fingerprint(data_dir) -> str | None:
    """The token files a run reads, as a hash: the tokenizer, each shard's name and token
    count, and the first and last MiB of each one's bytes (cheap at any size; a file
    re-made from other text differs there). None: no meta.json (no data yet)."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    h = hashlib.sha256(json.dumps([meta.get("tokenizer"), meta["shards"]]).encode())
    for split in sorted(meta["shards"]):
        for shard in meta["shards"][split]:
            with open(Path(data_dir) / shard["file"], "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 20)))
                h.update(f.read())
    return h.hexdigest()


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
    contents (rank 0, once every shard is written); meta.json also gets every file's
    piece descriptors (rank 0 reads them back from the files, see describe) and AdamW's
    scalars by name.

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
        fields = {"step": step, **meta(), "scalars": {}, "pieces": "@rows"}
        rows = []
        for r in range(world):  # Every file's descriptors, read back from the file.
            held = torch.load(partial / shard_name(r), weights_only=True, mmap=True)
            rows += describe(held.get("pieces", []), r)
            fields["scalars"].update(held.get("scalars", {}))
        text = json.dumps(fields, indent=1)
        # One piece a line: 07's shards make thousands of pieces at a cluster's scale.
        rows = [json.dumps(row) for row in rows]
        head, _, tail = text.rpartition('"@rows"')  # the last: a config string may match
        text = head + "[\n" + ",\n".join(rows) + "\n]" + tail
        atomic_write(partial / "meta.json", lambda tmp: tmp.write_text(text))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # Every shard's name is on disk already.
        fsync_dir(root)  # The rename itself.
        for old in complete_checkpoints(out_dir)[keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def write_shard():
        atomic_write(partial / shard_name(rank), lambda tmp: torch.save(shard, tmp))

    for part in (empty_folder, write_shard):
        mine = part if part is write_shard or rank == 0 else None
        all_or_none(mine, f"saving step {step}", world, device)
    # Every rank wrote its file (the vote): rank 0 reads their descriptors back (a
    # mapped load reads the pickled list, not the tensors), with no collective: NCCL has
    # no gather, and gather_object would open a channel to every rank.
    all_or_none(publish if rank == 0 else None, f"saving step {step}", world, device)


# The columns of meta.json's "pieces": one row per piece of every file.
PIECE_FIELDS = ["name", "state", "shape", "tp", "range", "file", "at"]


def describe(pieces: list, rank: int) -> list:
    """A file's pieces as meta.json's rows (PIECE_FIELDS): what each holds, and where:
    the file (its rank) and its place in the file's list of pieces."""
    rows = []
    for at, pc in enumerate(pieces):
        rows.append([pc["name"], pc["state"], pc["shape"], pc["tp"], pc["range"]])
        rows[-1] += [rank, at]
    return rows


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


def read_files(ckpt, wanted, reading: list | None = None) -> dict:
    """A checkpoint's meta.json and the files `wanted(meta)` names (a set of ranks),
    memory-mapped: a piece's bytes are read only when copied out. Returns meta.json's
    fields with "files" (rank -> its file) and "index" ((name, state) -> its pieces'
    rows, as dicts). `reading` gets each path before it is read (the one that failed is
    the last). Raises if a file's pieces are not those meta.json says it holds (name,
    state, size), so a damaged file falls back before the restore, not inside it."""
    reading = [] if reading is None else reading
    reading.append(ckpt / "meta.json")
    meta = json.loads(reading[-1].read_text())
    index = {}
    for row in meta.get("pieces", []):
        pc = dict(zip(PIECE_FIELDS, row, strict=True))
        index.setdefault((pc["name"], pc["state"]), []).append(pc)
    files = {}
    for r in sorted(wanted({**meta, "index": index})):
        reading.append(ckpt / shard_name(r))
        files[r] = torch.load(
            reading[-1], map_location="cpu", weights_only=True, mmap=True
        )
    for pcs in index.values():
        for pc in pcs:
            if pc["file"] not in files:
                continue
            held = files[pc["file"]]["pieces"][pc["at"]]
            size = held["tensor"].numel()  # Its header: no byte of it is read.
            if (held["name"], held["state"], size) != (pc["name"], pc["state"], numel(pc)):
                raise ValueError(f"{pc['file']}'s piece {pc['at']} is not meta.json's")
    return {**meta, "files": files, "index": index}


def numel(pc: dict) -> int:
    """A piece's elements, from its meta.json row: its range, else its whole TP cut."""
    if pc["range"] is not None:
        return pc["range"][1] - pc["range"][0]
    return math.prod(pc["shape"]) // (pc["tp"][3] if pc["tp"] else 1)


def load_newest(out_dir, rank: int, world: int, device, read, restore) -> dict | None:
    """The newest checkpoint every rank can read (`read(ckpt, reading)`: read_files),
    restored by `restore(shard)`.

    A file that cannot be read is named and the previous checkpoint tried, all ranks
    agreeing. A checkpoint that reads but does not fit (`restore` raises: another model)
    is no damage to fall back from: every rank hears of it and the run stops. `restore`
    runs no collective (a rank that raised would miss it: a hang); what it returns, if
    anything, runs on every rank after the vote. Files load to the CPU, since RNG states
    must stay CPU tensors. Returns what `read` returned, or None.
    """
    names = [[d.name for d in complete_checkpoints(out_dir)]]
    if world > 1:
        # Rank 0's listing for all: a node with a stale view of a shared filesystem must
        # not vote on another list (a hang).
        dist.broadcast_object_list(names, src=0)
    who = f"[rank {rank}]"
    for name in names[0]:
        ckpt = ckpt_root(out_dir) / name
        reading = []
        try:
            shard = read(ckpt, reading)
            ok = 1.0
        except Exception as e:  # noqa: BLE001 - any unreadable file: name it, go on.
            error = f"{type(e).__name__}: {str(e)[:120]}"
            path = reading[-1]
            what = f"{who} checkpoint file {path} is unreadable ({error})"
            print(f"{what}; trying the previous one")
            ok = 0.0
        if agree(ok, dist.ReduceOp.MIN, world, device) < 1.0:
            continue
        then = None
        try:
            then = restore(shard)
        except Exception as e:  # noqa: BLE001 - all ranks must hear of it, or hang.
            print(f"{who} {ckpt} does not fit this run: {str(e)[:200]}")
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


# ------------------------------------------- pieces: a tensor's slice, by global name
# The layout keys a file's RNG streams and PowerSGD state belong to.
RANK_ROLE = ("dp", "tp", "pp", "cp", "virtual_stages")
# AdamW's hyperparameters that belong to the device, not to the run.
DEVICE_KEYS = ("fused", "foreach", "capturable", "differentiable")


def global_names(run, skip_copies: bool) -> dict:
    """id(parameter) -> its name in one process's GPT. A later pipeline stage's copy of
    the tied embedding (05: lm_head.weight) is wte's; skip_copies leaves it out (the
    first stage writes it)."""
    names = {}
    for module in run.modules():
        tied = run.gpt_config.tie_embeddings
        holds_wte = "wte" in module.transformer
        for name, p in module.named_parameters():
            if tied and name == "lm_head.weight" and not holds_wte:
                if skip_copies:
                    continue
                name = "transformer.wte.weight"
            names[id(p)] = name
    return names


def tp_cut(name: str, grid) -> list | None:
    """[dim, chunks, tp rank, tp] of 04's cut of a tensor on this rank, or None."""
    layout = sharding.tp_layout(name) if grid.tp > 1 else None
    return None if layout is None else [*layout, grid.tp_rank, grid.tp]


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its bytes (torch.save writes a view's whole
    storage): t itself when it already is one, else a copy."""
    t = t.detach()
    whole = t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0
    if t.device.type == "cpu" and whole:
        return t
    return t.to("cpu", copy=True)


def piece(name, state, p, tensor, grid, span=None) -> dict:
    """One slice of a global tensor: `tensor` is [a, b) = span of this rank's TP cut of
    `name` (p: the parameter, for the cut's shape), flattened; None: all of it."""
    cut = tp_cut(name, grid)
    shape = list(p.shape)
    if cut:
        shape[cut[0]] *= cut[3]
    return dict(name=name, state=state, shape=shape, tp=cut, range=span, tensor=tensor)


def distinct_pieces(run) -> tuple[list, dict]:
    """This rank's pieces of the distinct state, and the optimizer's scalars by name.

    ZeRO: the pieces of this rank's shards (its slice of each flat's weights and AdamW
    moments: no gathering). What DP and CP replicas hold alike (every weight and its
    AdamW state without ZeRO, the frozen weights no flat holds with it) is spread over
    them (spread): each element written by one replica. A tensor 04 does not cut
    (LayerNorms, wpe, a row-parallel bias) is TP rank 0's to write.
    """
    grid = run.grid
    names = global_names(run, skip_copies=True)
    if grid.tp_rank > 0:  # What 04 does not cut, every TP rank holds alike: rank 0's.
        names = {i: n for i, n in names.items() if tp_cut(n, grid)}
    pieces = []
    scalars = {}
    flats = run.optimizer.flats if run.cfg.zero else []
    in_flats = {id(p) for f in flats for p in f.params}
    for f in flats:
        state = run.optimizer.local.state.get(f.shard, {})
        for p, o in f.offset.items():
            a = max(o, f.lo)  # p ∩ [lo, lo + S) is [a, b): its piece of the shard
            b = min(o + p.numel(), f.lo + f.S)
            if a >= b or id(p) not in names:
                continue
            name = names[id(p)]
            span = [a - o, b - o]
            for key, t in [("param", f.shard), *state.items()]:
                if t.dim() == 0:
                    scalars.setdefault(name, {})[key] = t.item()
                    continue
                t = on_cpu(t[a - f.lo : b - f.lo])
                pieces.append(piece(name, key, p, t, grid, span))
    alike = []  # (name, state, p, tensor): the same on every DP and CP replica
    for module in run.modules():
        for p in module.parameters():
            if id(p) in in_flats or id(p) not in names:
                continue
            name = names[id(p)]
            state = {} if run.cfg.zero else run.optimizer.state.get(p, {})
            for key, t in [("param", p), *state.items()]:
                if t.dim() == 0:
                    scalars.setdefault(name, {})[key] = t.item()
                    continue
                alike.append((name, key, p, t))
    for name, key, p, part, span in spread(alike, grid):
        pieces.append(piece(name, key, p, on_cpu(part), grid, span))
    return pieces, scalars


def spread(alike: list, grid) -> list:
    """This replica's part of the tensors the dp·cp replicas hold alike. Laid end to end
    in their order (the same on every replica) they are one stream of elements, cut into
    dp·cp equal ranges as 07 cuts a flat; replica r writes the r-th: (name, state, p, its
    part, flattened, and that part's span of the tensor). Every replica computes the same
    cut without a message, each writes its share to an element, and a tensor larger than
    a share (wte) is split where an edge falls inside it. One writer for all (the rule
    before) wrote 19 GB alone at dp 64."""
    me = grid.dp_rank * grid.cp + grid.cp_rank  # 0 .. dp·cp - 1
    share = -(-sum(t.numel() for *_, t in alike) // grid.dp_cp)  # ceil, as 07's shards
    lo = me * share
    mine = []
    start = 0  # where this tensor begins in the stream
    for name, key, p, t in alike:
        a = max(lo, start)
        b = min(lo + share, start + t.numel())
        if a < b:
            span = [a - start, b - start]
            mine.append((name, key, p, t.detach().reshape(-1)[span[0] : span[1]], span))
        start += t.numel()
    return mine


def rectangles(shape: list, cut, span) -> tuple[int, list]:
    """A slice of a global tensor as rectangles of it: (width, [(r0, r1, c0, c1, at)]).

    The slice is `span` (a flat range; None: all) of 04's `cut` (None: no cut) of a
    tensor of global `shape`, seen as 2-D (a vector as one row). Each rectangle is rows
    [r0, r1) x columns [c0, c1) of the global tensor; the slice's flat storage holds it
    from element `at`, a row every `width` (the cut's row length). A flat range of the
    cut is at most three rectangles (a partial row, whole rows, a partial row), and
    each one splits at the edges of 04's chunks (a fused [q|k|v]: three), inside which
    the cut is the global tensor shifted."""
    rows, cols = shape if len(shape) == 2 else (1, shape[0])
    dim, chunks, tp_rank, tp = cut if cut else (0, 1, 0, 1)
    dim = 1 if len(shape) == 1 else dim  # A vector's one dim: the row's columns.
    size = cols if dim else rows  # Along the cut, globally.
    part = size // (chunks * tp)  # One chunk's share of one rank, along the cut.
    width = cols // tp if dim else cols
    height = rows if dim else rows // tp
    a, b = span if span else (0, height * width)
    r0, c0 = divmod(a, width)
    r1, c1 = divmod(b, width)
    whole = r0 + (c0 > 0)  # The first whole row.
    flat = []  # Rectangles of the cut, (r0, r1, c0, c1): the range [a, b) of its rows.
    if r0 == r1:
        flat.append((r0, r0 + 1, c0, c1))
    else:
        flat.append((r0, whole, c0, width))  # Empty when c0 = 0: dropped below.
        flat.append((whole, r1, 0, width))
        flat.append((r1, r1 + 1, 0, c1))
    flat = [(r0, r1, c0, c1) for r0, r1, c0, c1 in flat if r0 < r1 and c0 < c1]
    out = []
    for r0, r1, c0, c1 in flat:
        lo, hi = (c0, c1) if dim else (r0, r1)
        for k in range(chunks):  # Chunk k: [k·part, (k+1)·part) of the cut, on dim.
            x0 = max(lo, k * part)
            x1 = min(hi, (k + 1) * part)
            if x0 >= x1:
                continue
            shift = k * (size // chunks) + tp_rank * part - k * part
            at = r0 * width + c0 - a + (x0 - lo) * (1 if dim else width)
            if dim:
                out.append((r0, r1, x0 + shift, x1 + shift, at))
            else:
                out.append((x0 + shift, x1 + shift, c0, c1, at))
    return width, out


def overlaps(src: tuple, dst: tuple):
    """(rows, columns, where in src, where in dst) of each block that two slices'
    rectangles (rectangles()) share: the intervals' intersections, no mask."""
    src_width, src_rects = src
    dst_width, dst_rects = dst
    for sr0, sr1, sc0, sc1, s_at in src_rects:
        for dr0, dr1, dc0, dc1, d_at in dst_rects:
            i0 = max(sr0, dr0)
            i1 = min(sr1, dr1)
            j0 = max(sc0, dc0)
            j1 = min(sc1, dc1)
            if i0 >= i1 or j0 >= j1:
                continue
            s = s_at + (i0 - sr0) * src_width + (j0 - sc0)
            d = d_at + (i0 - dr0) * dst_width + (j0 - dc0)
            yield i1 - i0, j1 - j0, s, d


def check_shape(name: str, saved: list, shape: list) -> None:
    """Raise unless a checkpoint's global shape fits this run's: the same, or wte's at
    another TP's vocabulary padding (64·tp zero rows, support/train/vocab: the rows
    past the saved ones stay zero, the saved ones past this run's are not read)."""
    same_rows = list(saved[1:]) == list(shape[1:])
    if list(saved) != list(shape) and not (name in vocab.KEYS and same_rows):
        raise ValueError(f"{name}: checkpoint shape {list(saved)}, here {list(shape)}")


def pieces_over(index: dict, name: str, state: str, need: tuple) -> list:
    """The pieces of `name`'s `state` that overlap a slice (shape, cut, span)."""
    pieces = index.get((name, state))
    if not pieces:
        raise ValueError(f"the checkpoint holds no {state} of {name}")
    check_shape(name, pieces[0]["shape"], need[0])
    mine = rectangles(*need)
    found = []
    for pc in pieces:
        theirs = rectangles(pc["shape"], pc["tp"], pc["range"])
        if next(overlaps(theirs, mine), None) is not None:
            found.append(pc)
    return found


def read_slice(files: dict, index: dict, name: str, state: str, need: tuple, out):
    """Copy the elements of a slice (shape, cut, span) of `name`'s `state` from the
    pieces that overlap it into `out` (its flat storage, on any device), block by
    block: nothing else is read. Raises if an element the checkpoint's shape holds is
    in no piece (or in two)."""
    shape, cut, span = need
    mine = rectangles(shape, cut, span)
    saved = index[(name, state)][0]["shape"]
    bounds = saved if len(saved) == 2 else [1, saved[0]]
    wanted = 0  # The slice's elements inside the saved shape (the rest: padding rows).
    for r0, r1, c0, c1, _ in mine[1]:
        wanted += max(0, min(r1, bounds[0]) - r0) * max(0, min(c1, bounds[1]) - c0)
    if wanted < out.numel():
        out.zero_()
    copied = 0
    for pc in pieces_over(index, name, state, need):
        src = files[pc["file"]]["pieces"][pc["at"]]["tensor"]
        theirs = rectangles(pc["shape"], pc["tp"], pc["range"])
        for n, m, s, d in overlaps(theirs, mine):
            block = src.as_strided((n, m), (theirs[0], 1), src.storage_offset() + s)
            into = out.as_strided((n, m), (mine[0], 1), out.storage_offset() + d)
            into.copy_(block)
            copied += n * m
    if copied != wanted:
        where = f"{name} ({state})"
        raise ValueError(f"{where}: {wanted} elements wanted, {copied} in the pieces")


def whole(shard: dict, name: str, state: str = "param") -> torch.Tensor:
    """A global tensor at its saved shape, read from its pieces (read_files' `shard`
    must hold their files): --export's weights, one at a time."""
    pieces = shard["index"][(name, state)]
    head = shard["files"][pieces[0]["file"]]["pieces"][pieces[0]["at"]]["tensor"]
    shape = pieces[0]["shape"]
    out = head.new_empty(torch.Size(shape).numel())
    read_slice(shard["files"], shard["index"], name, state, (shape, None, None), out)
    return out.view(shape)


def need_of(name: str, p, grid, span=None) -> tuple:
    """The slice of `name` this rank holds in p (its TP cut), or a flat span of it."""
    cut = tp_cut(name, grid)
    shape = list(p.shape)
    if cut:
        shape[cut[0]] *= cut[3]
    return shape, cut, span


def state_kinds(index: dict, name: str) -> list:
    """The optimizer's per-element states saved for `name` (AdamW: its two moments)."""
    return sorted(k for n, k in index if n == name and k != "param")


def load_optimizer(opt, params: list, states: list, saved_groups: list) -> None:
    """A torch optimizer's state_dict rebuilt: `states[i]` for params[i] (None: none),
    the saved hyperparameters (lr, betas, ...) but this run's device settings."""
    sd = opt.state_dict()
    slots = [i for g in sd["param_groups"] for i in g["params"]]
    found = {i: s for i, s in zip(slots, states, strict=True) if s is not None}
    for g, saved in zip(sd["param_groups"], saved_groups, strict=True):
        g.update({k: v for k, v in saved.items() if k not in DEVICE_KEYS})
    opt.load_state_dict({"state": found, "param_groups": sd["param_groups"]})


def check_names(saved: set, names: dict, run) -> None:
    """Raise unless the checkpoint's weights are this model's: no block past its
    n_layer, and, where this rank holds the whole model (pp 1), exactly its names."""
    layers = run.gpt_config.n_layer
    blocks = [n.split(".") for n in saved if n.startswith("transformer.h.")]
    beyond = sorted({int(b[2]) for b in blocks if int(b[2]) >= layers})
    if beyond:
        raise ValueError(
            f"the checkpoint holds block {beyond[0]}; this GPT has {layers}"
        )
    here = set(names.values())
    if run.grid.pp == 1 and saved != here:
        extra = sorted(saved - here)[:3]
        missing = sorted(here - saved)[:3]
        raise ValueError(f"the checkpoint holds {extra}, not {missing}")


def slices(run, index: dict):
    """Each slice of the state this rank holds: (name, state, need, p, f). need is
    (global shape, TP cut, flat span of the cut or None: all of it); f is the ZeRO flat
    whose shard holds p's span, or None: p itself (and torch's AdamW state of it).
    The optimizer's states are the ones the checkpoint holds for the name."""
    grid = run.grid
    names = global_names(run, skip_copies=False)
    flats = run.optimizer.flats if run.cfg.zero else []
    in_flats = {id(p) for f in flats for p in f.params}
    for module in run.modules():
        for p in module.parameters():
            if id(p) in in_flats:
                continue
            name = names[id(p)]
            kinds = [] if run.cfg.zero else state_kinds(index, name)
            for state in ["param", *kinds]:
                yield name, state, need_of(name, p, grid), p, None
    for f in flats:
        for p, o in f.offset.items():
            a = max(o, f.lo)
            b = min(o + p.numel(), f.lo + f.S)
            if a >= b:
                continue
            name = names[id(p)]
            for state in ["param", *state_kinds(index, name)]:
                yield name, state, need_of(name, p, grid, [a - o, b - o]), p, f


def files_needed(run, meta: dict) -> set:
    """The files (ranks) this rank reads: those holding a piece that overlaps a slice
    it holds, and, on the layout that wrote the checkpoint, its own (its RNG streams and
    PowerSGD's state). A checkpoint of another model reads as far as it can: restore
    says it does not fit, in one line."""
    index = meta["index"]
    files = set()
    for name, state, need, _, _ in slices(run, index):
        try:
            files.update(pc["file"] for pc in pieces_over(index, name, state, need))
        except ValueError:
            continue
    if same_layout(meta.get("config", {}), run.cfg):
        files.add(run.grid.rank)
    return files


def same_layout(saved: dict, cfg) -> bool:
    """Whether a checkpoint's config has this run's layout (RANK_ROLE)."""
    return all(saved.get(k) == getattr(cfg, k) for k in RANK_ROLE)


def restore_model(run, shard: dict):
    """Weights and AdamW's state into this rank's layout, each slice copied from the
    pieces that overlap it (read_slice): into each parameter and torch's AdamW without
    ZeRO; into each flat's shard and its moments with it. Nothing is assembled whole."""
    index = shard["index"]
    if not index:
        old = "written before meta.json listed them (2026-11-29)"
        raise ValueError(f"meta.json lists no pieces: {old}; resume with the code that wrote it")
    names = global_names(run, skip_copies=False)
    check_names({n for n, state in index if state == "param"}, names, run)
    opt = run.optimizer
    flats = opt.flats if run.cfg.zero else []
    read = partial(read_slice, shard["files"], index)
    saved_groups = [
        {k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}
        for g in shard["param_groups"]
    ]  # JSON's lists back to tuples (AdamW's betas).
    states = {}  # id(p), or id(f.shard) with ZeRO -> its AdamW state
    with torch.no_grad():
        for f in flats:
            f.shard.zero_()  # The padding past the flat's last weight: 0, as at init.
        for name, state, need, p, f in slices(run, index):
            key = id(p) if f is None else id(f.shard)
            if key not in states:
                steps = shard["scalars"].get(name, {})
                states[key] = {k: torch.tensor(v) for k, v in steps.items()}
            mine = states[key]
            if f is None:
                out = p.detach().view(-1)
                if state != "param":
                    out = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
                read(name, state, need, out)
                if state != "param":
                    mine[state] = out.view(p.shape)
                continue
            a, b = need[2]
            at = f.offset[p] + a - f.lo  # p's span in this rank's shard
            out = f.shard.detach() if state == "param" else mine.get(state)
            if out is None:
                out = mine[state] = torch.zeros_like(f.shard)  # on its GPU, not the host
            read(name, state, need, out[at : at + b - a])
        if not run.cfg.zero:
            params = [p for g in opt.param_groups for p in g["params"]]
            ordered = [states.get(id(p)) or None for p in params]
            load_optimizer(opt, params, ordered, saved_groups)
            return
        local = [p for g in opt.local.param_groups for p in g["params"]]
        ordered = [states.get(id(p)) or None for p in local]
        load_optimizer(opt.local, local, ordered, saved_groups)
        for g, saved in zip(opt.param_groups, saved_groups, strict=True):
            g.update(
                {k: v for k, v in saved.items() if k not in (*DEVICE_KEYS, "params")}
            )


def shard_of(run, step: int) -> dict:
    """This rank's file of a train.Run: its pieces of the distinct state (distinct_pieces)
    and its own RNG streams and PowerSGD state, the scaler, the step and the config.

    Dropout's generators are saved: the default one (and CUDA's), and 04's per-rank
    tracker. Python's and NumPy's go unused (01's loader has its own).
    """
    cfg = run.cfg
    rng = {"torch": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    tp_rng = getattr(run.modules()[0], "tp_rng", None)
    pieces, scalars = distinct_pieces(run)
    shard = {"pieces": pieces, "scalars": scalars}
    groups = run.optimizer.param_groups
    shard["param_groups"] = [
        {k: v for k, v in g.items() if k != "params"} for g in groups
    ]
    shard["scaler"] = run.scaler.state_dict()
    shard["rng"] = rng
    shard["tp_rng"] = None if tp_rng is None else tp_rng.state_dict()
    shard["powersgd"] = [p.state_dict() for p in powersgd_states(run.chunks)]
    shard["step"] = step  # The data position too: batches are a function of the step.
    shard["data_position"] = list(run.train.position(step))
    shard["config"] = asdict(cfg)
    return shard


def restore(run, shard: dict):
    """A checkpoint (read_files: meta.json's fields and the files this rank reads) into
    a train.Run, with no collective; raises if it does not fit (another model). Returns
    what is left for every rank to run once all agree that it fits: ZeRO-1/2's
    all-gather of the weights, or None. The RNG streams and PowerSGD's state come back
    from this rank's own file on the layout that wrote it; on another, this run's own
    (a new run's) go on."""
    restore_model(run, shard)
    if shard["scaler"]:
        run.scaler.load_state_dict(shard["scaler"])
    if same_layout(shard["config"], run.cfg):
        own = shard["files"][run.grid.rank]
        states = powersgd_states(run.chunks)
        for p, state in zip(states, own.get("powersgd", []), strict=True):
            p.load_state_dict(state)
        if own["tp_rng"] is not None:
            run.modules()[0].tp_rng.load_state_dict(own["tp_rng"])
        torch.set_rng_state(own["rng"]["torch"])
        if "cuda" in own["rng"]:
            torch.cuda.set_rng_state(own["rng"]["cuda"], run.device)
    return run.optimizer.gather_weights if run.cfg.zero else None


def save_checkpoint(run, step: int) -> None:
    """Save a train.Run at `step`: every rank's file, and rank 0's meta.json."""
    cfg = run.cfg
    grid = run.grid

    def meta():  # Rank 0's, once the files are written (see save).
        fields = {"world": grid.world, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}
        fields["cp"] = cfg.cp
        fields["model_config"] = asdict(run.gpt_config)
        fields["tokenizer"] = tokenizer_name(cfg.data_dir)
        fields["data_fingerprint"] = data_fingerprint(cfg.data_dir)
        fields["config"] = asdict(cfg)
        for key in ("data_position", "scaler", "param_groups"):  # Alike on all ranks.
            fields[key] = shard[key]
        return fields

    shard = shard_of(run, step)
    keep = cfg.keep_checkpoints
    save(cfg.out_dir, step, grid.rank, grid.world, run.device, shard, meta, keep)


def load_checkpoint(run) -> int:
    """Restore a train.Run from the newest checkpoint every rank can read (load_newest);
    returns the step to continue from (0: none)."""
    grid = run.grid

    def read(ckpt, reading):
        return read_files(ckpt, partial(files_needed, run), reading)

    where = (run.cfg.out_dir, grid.rank, grid.world, run.device)
    shard = load_newest(*where, read, partial(restore, run))
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
