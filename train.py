"""train.py · everything together: 4D-parallel (DP x CP x TP x PP) GPT training.

The idea: build the same GPT on every rank, cut it with tensor parallelism (04) inside
a node and pipeline parallelism (05) across nodes, replicate that with data parallelism
(03, or 07's ZeRO stages 1-3), and train it in mixed precision (06), recomputing (06b).
Long sequences are cut over --cp ranks, K and V passed around a ring in attention (08).
Checkpoint (resumable bit for bit), evaluate, log and measure every step. Or fine-tune
GPT-2's weights (--init-from): all of them, or LoRA's factors only (--lora-rank, 02).

The grid is arange(world).view(pp, dp, cp, tp), built by support/train/grid.py: TP and CP
peers share a node's NVLink, and only pipeline sends cross nodes. --dp 2 --tp 2 --pp 2:

                   tp_rank 0   tp_rank 1
    pp 0, dp 0  |  rank 0      rank 1    |  embeddings + the first half of the blocks,
    pp 0, dp 1  |  rank 2      rank 3    |  each rank with half of every matrix
    pp 1, dp 0  |  rank 4      rank 5    |  the second half of the blocks + head + loss
    pp 1, dp 1  |  rank 6      rank 7    |
    groups: TP {0,1} {2,3} {4,5} {6,7}; DP {0,2} {1,3} {4,6} {5,7}; PP {0,4} {1,5} ...

Batch semantics (as Megatron): --batch-size B is the global batch in sequences per
optimizer step, run as m = B / (micro_batch_size * dp) microbatches per DP rank:
accumulation steps without PP, the pipeline's microbatches with it. Any layout with the
same B gives one process's loss curve (fp32, up to rounding).

Launch:
    python train.py               # a laptop: prepares the data, ~4 min on a CPU
    torchrun --standalone --nproc_per_node=8 train.py --dp 2 --tp 2 --pp 2
    python train.py --init-from gpt2-hf --model gpt2 --tokenizer gpt2 --lora-rank 8
    python train.py --export out/run  # model.pt, one file from a sharded checkpoint
    python train.py --sample out/run/model.pt      # a cluster: docs/cluster.md

What changed from 09: nothing new is taught; 01-08 composed (09 plans the run and its
log's predictions), with what a real run needs (an LR schedule, global-norm clipping,
evaluation, MFU). Plumbing lives in support/.
"""

import functools
import importlib
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from support import distributed
from support.train import checkpoint, command_line, config, recipe, run_log, vocab
from support.train import export as export_lib
from support.train import grid as grid_lib
from support.train.config import ConfigError, TrainConfig
from support.train.lr_schedule import LR_SCHEDULES, lr_at  # warm-up, then a decay
from support.train.prefetch import Prefetcher
from support.train.run import Run, adamw_groups, describe

data_lib = importlib.import_module("01_data")
model_lib = importlib.import_module("02_model")
ddp_lib = importlib.import_module("03_ddp")
compression_lib = importlib.import_module("03b_compression")
tp_lib = importlib.import_module("04_tensor_parallel")
sp_lib = importlib.import_module("04b_sequence_parallel")
pp_lib = importlib.import_module("05_pipeline")
sched_lib = importlib.import_module("05b_schedules")
zb_lib = importlib.import_module("05c_zero_bubble")  # --schedule zb1's B/W split
mp_lib = importlib.import_module("06_mixed_precision")
recompute_lib = importlib.import_module("06b_recompute")
zero_lib = importlib.import_module("07_zero")
cp_lib = importlib.import_module("08_context_parallel")
plan_lib = importlib.import_module("09_plan")  # --plan, and the log's predictions.


# ------------------------------------------ validation: one line per bad flag, up front
def resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """--dtype as a torch dtype; auto is bf16 on a GPU that has it, else fp32."""
    if cfg.dtype != "auto":
        return mp_lib.DTYPES[cfg.dtype]
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float32


def check_flags(cfg: TrainConfig, world_size: int) -> None:
    """support/train/config's checks that need no file, given the lessons' choices and 05b's
    pipeline check (a known schedule, virtual stages only interleaved, ...)."""
    choices = {
        "dtype": ("auto", *mp_lib.DTYPES),
        "model": tuple(model_lib.PRESETS),
        "recompute": recompute_lib.RECOMPUTE,
        "lr_schedule": LR_SCHEDULES,
        "grad_compression": ("none", "fp16", "bf16", "powersgd"),
    }
    config.check_flags(cfg, world_size, choices, model_lib.PRESETS, sched_lib.check_config)


def validate(cfg: TrainConfig, world_size: int, rank: int = 0, plan: bool = False):
    """Flags first (so bad input writes nothing), then the data, model and loader; with
    `plan` (--plan) the model only, of the data's vocabulary or its tokenizer's.

    Returns 02's GPTConfig: the preset, its context cut to --block-size (so no position
    goes untrained), its vocabulary padded for TP.
    """
    if cfg.init_from and not cfg.model:  # No --model: the checkpoint's shape.
        have = config.read_init_from(cfg, pretrained).config
        config.shape_of_init_from(cfg, have, model_lib.PRESETS)
    check_flags(cfg, world_size)
    model_config(cfg, None)  # Its heads and sizes, before any data is made.
    if plan:  # No data is made or read.
        meta = {"vocab_size": config.plan_vocab_size(cfg)}
    else:
        config.prepare_default_data(cfg, rank, data_lib.main)
        meta = config.read_data_meta(cfg)
    grown = config.check_block_size(cfg, model_lib.PRESETS[cfg.model]["block_size"])
    if grown and rank == 0:  # More positions than the preset: said first.
        print(grown)
    gpt_config = model_config(cfg, meta["vocab_size"])
    if plan:
        return gpt_config
    config.check_data(cfg, gpt_config.block_size, data_lib.DataLoader)
    if cfg.init_from:  # Last, since it reads the whole checkpoint.
        fewer = config.check_init_from(cfg, meta, gpt_config, pretrained)
        if fewer and rank == 0:  # Rows beyond the checkpoint's: from the init.
            print(fewer)
    checkpoint.check_out_dir(cfg)
    checkpoint.check_resume_shape(cfg, gpt_config)  # Another shape: one line, up front.
    return gpt_config


def model_config(cfg: TrainConfig, vocab_size: int | None):
    """02's GPTConfig: --model's preset, the shape flags over it, the data's vocabulary
    (None: the preset's) unless --vocab-size; checked for --tp."""
    sizes = config.model_sizes(cfg, vocab_size)  # n_layer, n_head, n_embd, V, T
    extra = dict(dropout=cfg.dropout, pad_vocab_multiple=vocab.tp_multiple(cfg.tp))
    try:  # GPTConfig's checks (n_embd % n_head, ...), then 04's (whole heads a rank).
        gpt_config = model_lib.GPTConfig.from_preset(cfg.model, **sizes, **extra)
        tp_lib.check_tp_config(gpt_config, cfg.tp)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"--model {cfg.model} --tp {cfg.tp}: {e}") from None
    return gpt_config


@functools.lru_cache(maxsize=1)
def pretrained(path: str):
    """--init-from's GPT (02 reads GPT-2's files), read once per rank: validate checks
    its shape, build_chunks copies its weights and then empties this cache."""
    return model_lib.GPT.load_pretrained(Path(path).resolve(strict=True))


# ---------------------------------------------- the process grid (support/train/grid.py)
def build_grid(cfg: TrainConfig, rank: int, world: int) -> grid_lib.Grid:
    """This rank's place in arange(world).view(pp, dp, cp, tp) and its groups, with 05's
    embedding group (the first and last stage, which hold the tied embeddings)."""
    sizes = (cfg.pp, cfg.dp, cfg.tp)
    return grid_lib.build_grid(*sizes, rank, world, pp_lib.embedding_group, cfg.cp)


# ------------ building: model (02) -> TP shards (04) -> pipeline chunks (05) -> DP (03)
def build_chunks(cfg: TrainConfig, gpt_config, grid: grid_lib.Grid, device) -> list:
    torch.manual_seed(cfg.seed)  # The same full model on every rank, before sharding.
    model = model_lib.GPT(vocab.one_process(gpt_config)).to(device)  # 64 rows padded
    if cfg.init_from:  # GPT-2's weights (wpe: its first T rows; vocab padding: init).
        weights = pretrained(cfg.init_from).state_dict()
        for name, t in model.state_dict().items():  # Detached: t shares the storage.
            t[: len(weights[name])].copy_(weights[name][: len(t)])
        pretrained.cache_clear()  # Its memory back.
    vocab.grow_rows(model, gpt_config)  # TP's padding: zero rows (support/train/vocab).
    if cfg.lora_rank:  # The base frozen as loaded; A alike on every rank (this seed).
        model_lib.apply_lora(model, cfg.lora_rank, cfg.lora_alpha)
    if grid.tp > 1:  # 04's split; with --sequence-parallel, 04b's, built on it.
        apply = (tp_lib.apply_tensor_parallel, sp_lib.apply_sequence_parallel)
        apply[cfg.sequence_parallel](model, grid.tp_group, seed=cfg.seed)
    if grid.cp > 1:  # 08: the ring in every attention, wpe at the chunks' positions.
        cp_lib.apply_context_parallel(model, grid.cp_group)
    recompute_lib.apply_recomputation(model, cfg.recompute)  # 06b: what a block keeps
    chunks = [model]
    if grid.pp > 1:
        chunks = pp_lib.split_model(model, grid.pp_rank, grid.pp, cfg.virtual_stages)
        chunks = zb_lib.split_for_schedule(chunks, cfg.schedule)  # zb1: B now, W later
    for chunk in chunks:
        if cfg.loss == "chunked":  # 06b: lm_head + loss, 1,024 tokens at a time.
            recompute_lib.apply_chunked_loss(chunk, chunk_tokens=1024)
        if cfg.compile:
            chunk.compile()  # In place: parameter names (and checkpoints) unchanged.
    # Dropout streams, none shared. Replicated activations draw from the default
    # generator, seeded per (stage, replica), so alike on TP peers (their copies must
    # stay copies); sharded ones (heads; with SP, token shards) from 04's tracker,
    # seeded seed + 1 + world + global rank, above this seed.
    torch.manual_seed(cfg.seed + 1 + grid.pp_rank * grid.dp + grid.dp_rank)
    return chunks


def data_parallel(cfg: TrainConfig, chunks: list, grid: grid_lib.Grid, device):
    """AdamW (decay on matrices only, fused on CUDA) and, with dp > 1, 03's data
    parallelism at --zero's stage. Returns (DP-wrapped chunks, optimizer, what the
    scaler steps)."""
    tied = [pp_lib.tied_parameter(c) for c in chunks] if grid.pp > 1 else []
    groups = adamw_groups(chunks, tied, cfg.weight_decay)
    AdamW = torch.optim.AdamW
    kw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    if cfg.zero:  # (dp > 1: checked) One ZeroOptimizer over every chunk's units.
        for c in chunks:  # The replicas made identical, then cut into shards.
            ddp_lib.broadcast_from_first_rank(c, grid.dp_cp_group)
        units = [u for c in chunks for u in zero_lib.zero_units(c)]
        kw.update(units=units, stage=cfg.zero)
        opt = zero_lib.ZeroOptimizer(groups, AdamW, grid.dp_cp_group, **kw)
        shards = [f.shard for f in opt.flats]  # Their .grad: this rank's gradients.
        scaled = SimpleNamespace(param_groups=[{"params": shards}], step=opt.step)
        return [zero_lib.ZeroDataParallel(c, opt) for c in chunks], opt, scaled
    if grid.dp_cp > 1:  # The same PowerSGD seed on every rank: 03b's default.
        half = {"fp16": torch.half, "bf16": torch.bfloat16}.get(cfg.grad_compression)
        for i, c in enumerate(chunks):  # --grad-compression picks one of 03b's hooks.
            hook = compression_lib.HalfPrecision(half) if half else None
            if cfg.grad_compression == "powersgd":
                args = (c.parameters(), cfg.powersgd_rank, cfg.powersgd_warmup_steps)
                hook = compression_lib.PowerSGD(*args)
            chunks[i] = ddp_lib.DataParallel(c, group=grid.dp_cp_group, comm_hook=hook)
    opt = AdamW(groups, **kw)
    return chunks, opt, opt


def build_run(cfg: TrainConfig, gpt_config, grid: grid_lib.Grid, device) -> Run:
    T = gpt_config.block_size  # The context is --block-size.
    dtype = resolve_dtype(cfg, device)
    chunks = build_chunks(cfg, gpt_config, grid, device)
    wrapped = data_parallel(cfg, chunks, grid, device)
    scaler = mp_lib.make_scaler(dtype)  # Group None: all ranks skip a step together.
    per_rank = cfg.batch_size // cfg.dp  # This DP rank's share of every batch.
    args = (per_rank, T, cfg.seed, grid.dp_rank, cfg.dp)
    # The next step's batch read, pinned and copied during this one (support/train/prefetch).
    # With CP, each rank keeps its 2 zigzag chunks of every sequence (08): (B/dp, T/cp).
    loader = data_lib.DataLoader(cfg.data_dir, "train", *args)
    train = Prefetcher(grid_lib.cp_chunks(loader, grid, cp_lib.zigzag_split), device)
    val = data_lib.DataLoader(cfg.data_dir, "val", *args, device)
    val = grid_lib.cp_chunks(val, grid, cp_lib.zigzag_split)
    m = per_rank // cfg.micro_batch_size
    return Run(cfg, grid, gpt_config, device, dtype, *wrapped, scaler, train, val, T, m)


# --------------------------------------------------------------------------- one step
def pipeline(run: Run, x: torch.Tensor, y: torch.Tensor, **kwargs):
    """05b's pipeline_step on this rank's chunks (activations (b, T/cp, C); SP: /tp)."""
    T = run.T // run.grid.cp
    T = T // run.grid.tp if run.cfg.sequence_parallel else T
    kwargs["act_shape"] = (run.cfg.micro_batch_size, T, run.gpt_config.n_embd)
    kwargs["dtype"] = run.dtype  # Autocast's, in 05b's forwards only; sent in it.
    args = (run.chunks, (x, y), run.m, run.cfg.schedule, run.grid.pp_group)
    return sched_lib.pipeline_step(*args, **kwargs)


def gradients(run: Run) -> list:
    """(parameter, gradient) pairs. Under ZeRO: this rank's pieces of the averaged
    gradients in its shards (07's grad_pieces; ZeRO-1 reduce-scatters there)."""
    if run.cfg.zero:
        return [(p, piece) for p, _, piece in run.optimizer.grad_pieces()]
    params = [p for m in run.modules() for p in m.parameters()]
    return [(p, p.grad) for p in params if p.grad is not None]


def global_grad_norm(run: Run, grads) -> torch.Tensor:
    """The whole model's gradient L2 norm, the same on every rank: squares summed over
    TP shards (replicated parameters once: 04), stages (not the last stage's tied copy:
    05 synced it) and, under ZeRO, DP ranks (each holds pieces of the shards)."""
    later = [m for m in run.modules() if run.grid.pp > 1 and not m.is_first]
    tied = [pp_lib.tied_parameter(m) for m in later]
    grads = [(p, g) for p, g in grads if all(p is not t for t in tied)]
    if run.grid.tp > 1:
        squares = tp_lib.grad_norm_squared(grads, run.grid.tp_group, run.device)
    elif grads:  # Foreach kernels, as torch's clipping: a few launches, not 3 a tensor.
        squares = torch.nn.utils.get_total_norm([g.float() for _, g in grads]).square()
    else:
        squares = torch.zeros((), device=run.device)
    if run.cfg.zero:
        squares = run.grid.all_reduce_sum(squares, "dp_cp")
    return run.grid.all_reduce_sum(squares, "pp").sqrt()


def comm_bytes(run: Run) -> int:
    """The gradient bytes this rank gave the DP collectives so far (03 counts them)."""
    if run.cfg.zero:
        return run.optimizer.stats["reduce_scatter_bytes"]
    return sum(c.stats["allreduce_bytes"] for c in run.chunks)  # DataParallel's.


def train_step(run: Run, step: int) -> dict:
    """One optimizer step. Every microbatch's token losses are SUMmed and divided by the
    step's token count over all DP replicas (06), with PP or without, so ignored (-1)
    targets weigh as in one big batch. Returns the stats: this rank's share of the step's
    mean loss (summed_loss adds them up) and grad_norm stay 0-dim device tensors, so a
    plain step never makes the CPU wait for the GPU (a host-device sync), nor runs the
    loss's collectives: the log reads them, at its steps only."""
    cfg = run.cfg
    grid = run.grid
    x, y = run.train.get_batch(step)  # (B/dp, T), prefetched; step + 1's starts now.
    sent = comm_bytes(run) if grid.dp_cp > 1 else 0
    run.optimizer.zero_grad(set_to_none=True)
    b = cfg.micro_batch_size
    microbatches = list(zip(x.split(b), y.split(b)))
    # 0-dim tensors from here on, never read on the host (a sync): see the docstring.
    # With CP, the step's tokens are on dp x cp ranks: N sums over all of them (08).
    n_tokens = mp_lib.global_token_count(microbatches, group=grid.dp_cp_group)
    if grid.pp == 1:  # Accumulation over m microbatches (06).
        kwargs = dict(dp_size=grid.dp_cp, scaler=run.scaler, dtype=run.dtype)
        model = run.chunks[0]
        loss = mp_lib.accumulate_gradients(model, microbatches, n_tokens, **kwargs)
    else:  # The pipeline's microbatches (05): only the last stage's loss is not 0.
        kwargs = dict(embed_group=grid.embed_group, n_tokens=n_tokens)
        kwargs["dp_size"] = grid.dp_cp  # DP x CP average the gradients.
        kwargs["scale"] = run.scaler.get_scale()  # 06's fp16 loss scale
        loss = pipeline(run, x, y, **kwargs).loss
    grads = gradients(run)
    if cfg.zero >= 2 and grid.embed_group is not None:
        # 05 found no p.grad to sync: sum the tied matrix's shards, cut alike on both.
        tied = [pp_lib.tied_parameter(m) for m in run.modules()]
        for piece in (g for p, g in grads if any(p is t for t in tied)):
            dist.all_reduce(piece, group=grid.embed_group)
    run.scaler.unscale_(run.scaled)  # True gradients, before measuring and clipping.
    norm = global_grad_norm(run, grads)
    if cfg.grad_clip > 0:  # x min(1, clip / (norm + 1e-6)) on the device: no branch.
        params = [p for group in run.scaled.param_groups for p in group["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm)
    lr = lr_at(cfg, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    # fp16 only: skipped on every rank if gradients overflowed, which the host must
    # know, so 06's scaler reads its flag, one sync a step (as torch's GradScaler).
    run.scaler.step(run.scaled)
    run.scaler.update()
    stats = {"loss": loss, "lr": lr, "grad_norm": norm}  # Read at log steps only.
    if run.scaler.is_enabled():  # A skipped step is always logged (train).
        stats["skipped"] = run.scaler.last_step_skipped
    if grid.dp_cp > 1:
        stats["comm_bytes"] = comm_bytes(run) - sent
    return stats


def summed_loss(run: Run, stats: dict) -> dict:
    """stats with the step's loss: the ranks' shares added up (the stages': only the last
    one's is not 0; the DP x CP ranks'), two collectives that only a logged step runs."""
    loss = run.grid.all_reduce_sum(stats["loss"], "pp")
    return {**stats, "loss": run.grid.all_reduce_sum(loss, "dp_cp")}


@torch.no_grad()
def evaluate(run: Run, stop=lambda: False) -> float | None:
    """Mean validation loss over the same eval_steps batches every time, with the same
    collectives on every rank. `stop()`, a collective, is asked before each batch: True
    returns None at once (preempted: train() saves and exits)."""
    chunks = torch.nn.ModuleList(run.chunks).eval()  # One .eval() reaches every chunk.
    total = torch.zeros((), device=run.device)
    b = run.cfg.micro_batch_size
    for i in range(run.cfg.eval_steps):
        if stop():  # Half an evaluation is no loss.
            chunks.train()
            return None
        x, y = run.val.get_batch(i)
        with mp_lib.autocast_context(run.dtype, run.device.type):
            if run.grid.pp > 1:  # The last stage's mean over m microbatches, else 0.
                n = (y != -1).sum()  # A tensor: 05 would read its own count (a sync).
                total += pipeline(run, x, y, forward_only=True, n_tokens=n).loss
            else:
                for xb, yb in zip(x.split(b), y.split(b)):
                    total += run.chunks[0](xb, yb)[1].float() / run.m
    chunks.train()
    total = run.grid.all_reduce_sum(total, "pp")
    # Each DP x CP rank's mean over its own tokens (as many on each): their mean.
    total = run.grid.all_reduce_sum(total, "dp_cp") / run.grid.dp_cp
    return total.item() / run.cfg.eval_steps


# --------------------------------------- export and sampling: one file, one process
def new_model(model_config: dict):
    return model_lib.GPT(model_lib.GPTConfig(**model_config))


def export(run_dir) -> Path:
    """Assemble the newest readable checkpoint's weights into RUN_DIR/model.pt."""
    lessons = (model_lib.merge_lora, new_model, data_lib.get_tokenizer)
    return export_lib.export(run_dir, *lessons)


def load_exported(path) -> tuple:
    """model.pt -> (02_model.GPT on the CPU, the whole blob)."""
    return export_lib.load_exported(path, new_model)


def sample(model_pt, prompt: str, n_tokens: int, seed: int = 0) -> str:
    """The prompt and n_tokens sampled after it (temperature 0.8, top 50), decoded."""
    model, blob = load_exported(model_pt)
    t = blob["tokenizer"]  # A name (an old model.pt: a path), or a BPE's parts.
    tok = data_lib.get_tokenizer(t) if isinstance(t, str) else data_lib.Tokenizer(**t)
    return export_lib.generate_text(model, tok, prompt, n_tokens, seed)


# ------------------------------------------------------------------ the log and MFU
def open_log(run: Run, start: int) -> run_log.Logger:
    """metrics.jsonl from `start` on, told 02's FLOPs for MFU and HFU, and 09's plan."""
    # 02's FLOPs a token, 6N + attention; with LoRA, no frozen weight's own gradient.
    flops = model_lib.flops_per_token(run.gpt_config, run.T, run.cfg.lora_rank)
    redo = model_lib.recompute_flops_per_token(run.gpt_config, run.T, run.cfg.recompute)
    dtype = {v: k for k, v in mp_lib.DTYPES.items()}[run.dtype]
    return run_log.open_log(run, start, flops, dtype, plan_lib.plan_run, redo)


# --------------------------------------------------------------------------- the loop
def save(run: Run, log: run_log.Logger, step: int) -> int:
    """save_checkpoint at `step`, its time left out of tokens/s. Returns the step."""
    with log.paused():
        checkpoint.save_checkpoint(run, step)
    return step


def train(run: Run) -> None:
    cfg = run.cfg
    # Watch first: a signal during the load counts too.
    signals = checkpoint.Preemption(run.grid.world, run.device, cfg.vote_interval)
    if run.grid.rank == 0:
        checkpoint.remove_partials(cfg.out_dir)
    start = checkpoint.load_checkpoint(run) if cfg.resume else 0
    signals.start_at(start)
    log = open_log(run, start)
    stop = cfg.max_steps
    if cfg.steps_this_run:
        stop = min(cfg.max_steps, start + cfg.steps_this_run)
    saved = None  # The step of this run's newest checkpoint.
    step = start - 1
    for step in range(start, stop):
        stats = train_step(run, step)
        if step % cfg.log_interval == 0 or step == stop - 1 or stats.get("skipped"):
            log.train_row(step, summed_loss(run, stats))  # A sync: reads loss and norm.
        val = 0.0  # None: preempted while evaluating (all ranks agree), as by a vote.
        if cfg.eval_interval and step % cfg.eval_interval == 0:  # Step 0: a baseline.
            with log.paused():  # Not a training step's time.
                val = evaluate(run, signals.asked)
            if val is not None:
                log.val_row(step, val)
        if cfg.ckpt_interval and (step + 1) % cfg.ckpt_interval == 0:
            saved = save(run, log, step)
        # A collective and a sync, at the steps the ranks agreed (alone: free, each step).
        if val is None or signals.at(step):
            distributed.print0(f"preemption signal: saving at step {step} and exiting")
            if saved != step:
                save(run, log, step)
            return
    if step >= start and saved != step:
        save(run, log, step)
    just_evaluated = cfg.eval_interval and step % cfg.eval_interval == 0  # In the loop.
    if stop == cfg.max_steps and step >= start and not just_evaluated:
        with log.paused():
            val = evaluate(run, signals.asked)
        if val is None:
            return  # Preempted in the last evaluation: saved already, so exit now.
        log.val_row(step, val)
    if run.grid.rank == 0:  # One process exports the last checkpoint, plots, samples.
        model_pt = export(cfg.out_dir)
        plot = run_log.plot_losses(cfg.out_dir)
        print(f"exported {model_pt} (step {step}); loss curve: {plot}")
        if cfg.sample_tokens:
            text = sample(model_pt, "\n", cfg.sample_tokens, seed=cfg.seed)
            print(f"--- sample ({cfg.sample_tokens} tokens) ---\n{text}\n---")


def main(argv=None) -> None:
    # --help lists the lessons' values of these two.
    listed = {"model": tuple(model_lib.PRESETS), "recompute": recompute_lib.RECOMPUTE}
    cfg, args = command_line.parse_args(argv, __doc__.split("\n")[0], listed)
    if args.export:
        print(f"wrote {export(args.export)}")
        return
    if args.sample:
        print(sample(args.sample, args.prompt, cfg.sample_tokens or 200, cfg.seed))
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.plan:  # The layout's GPUs, not this process's world: nothing launches.
        world = cfg.dp * cfg.cp * cfg.tp * cfg.pp
    try:  # Everything that can be checked, before any process group or file exists.
        gpt_config = validate(cfg, world, int(os.environ.get("RANK", 0)), args.plan)
        if args.plan:  # 09's plan on --plan-gpu, else this machine's GPU.
            where = (args.plan_gpu or run_log.gpu_key(), args.gpus_per_node)
            plan = run_log.plan_of(plan_lib.plan_run, cfg, gpt_config, *where)
    except ConfigError as e:
        raise SystemExit(f"train.py: error: {e}") from None
    if args.plan:  # Printed, and no process group, data or file made.
        return print(run_log.plan_text(plan, cfg, gpt_config))
    if int(os.environ.get("RANK", 0)) == 0:  # Rerun it: --config OUT/config.toml.
        recipe.write(cfg, Path(cfg.out_dir) / "config.toml")
    created = not dist.is_initialized()
    timeout_s = 60 * cfg.timeout_minutes  # Rank 0 saves alone, behind barriers.
    rank, _, world, device = distributed.init_distributed(timeout_s)
    try:
        run = build_run(cfg, gpt_config, build_grid(cfg, rank, world), device)
        distributed.print0(describe(run))
        try:
            train(run)
        finally:  # Every exit, preempted too, stops the prefetch thread.
            run.train.close()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
