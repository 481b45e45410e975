"""bench/bench_model.py: our GPT's training step against a plain reference GPT-2 of the same shape.

The reference is the textbook GPT-2 (minGPT style): the same modules and parameters, but attention
written out as softmax(q k^T / sqrt(hs) + causal mask) @ v, which builds the (B, nh, T, T) score
matrix, where 02_model.py calls F.scaled_dot_product_attention(is_causal=True). Attention is the
only difference, so the ratio measures it. Before timing, the reference gets our weights and
must produce our logits: the two compute the same function.

One training step = forward, backward, AdamW step, on a fixed batch. The two models alternate
step by step, so drift in the machine's speed hits both alike; the median step time is reported,
with the model FLOP/s it achieves (tokens/s x 02's flops_per_token; MFU divides that by a GPU's
peak, through bench/timing.py; a CPU has no entry). First it prints every preset's shape, size and
FLOPs/token with attention's share of them (02_model.py's demo prints the sizes only).
Target: ours at least as fast per step as the reference on CPU.

On a GPU (the default device when there is one) it times GPT-2 124M (B=8, T=1024) instead, in
fp32 and in bf16 autocast: the reference's (B, nh, T, T) scores are what flash attention never
writes to memory.

Run:  python bench/bench_model.py            (--help for flags; about a minute on 2 CPU cores)
"""

import argparse
import importlib
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: numbered files
from bench import timing  # noqa: E402

model_lib = importlib.import_module("02_model")
shapes_only = importlib.import_module("support.meta").shapes_only
GPT = model_lib.GPT
GPTConfig = model_lib.GPTConfig


class PlainAttention(nn.Module):
    """Causal self-attention the straightforward way: explicit scores, mask, softmax."""

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        T = config.block_size
        self.n_head = config.n_head
        self.c_attn = nn.Linear(C, 3 * C, bias=config.bias)
        self.c_proj = nn.Linear(C, C, bias=config.bias)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))  # (T, T): True = may attend
        self.register_buffer("mask", causal, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))  # (B, nh, T, T)
        scores = scores.masked_fill(~self.mask[:T, :T], float("-inf"))
        y = F.softmax(scores, dim=-1) @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, T, C)


class PlainBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.ln_1 = nn.LayerNorm(C, bias=config.bias)
        self.ln_2 = nn.LayerNorm(C, bias=config.bias)
        self.attn = PlainAttention(config)
        self.mlp = nn.ModuleDict(
            dict(
                c_fc=nn.Linear(C, 4 * C, bias=config.bias),
                gelu=nn.GELU(approximate="tanh"),
                c_proj=nn.Linear(4 * C, C, bias=config.bias),
            )
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m.c_proj(m.gelu(m.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    """GPT-2 with the same parameter names as 02_model.GPT, so it can load our state dict."""

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        V = config.padded_vocab_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(V, C),
                wpe=nn.Embedding(config.block_size, C),
                h=nn.ModuleList([PlainBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(C, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def print_presets():
    """Every preset's shape, parameters (module == count_params), FLOPs/token and the share of
    those FLOPs in attention's own matmuls, 12·L·nh·hs·T of 6N + 12·L·nh·hs·T."""
    head = f"{'preset':<12} {'L':>3} {'nh':>3} {'C':>5} {'T':>5} {'V':>6} {'params':>15}"
    print(f"{head} {'non-embedding':>15} {'FLOPs/token':>15} {'attention':>9}")
    for name in model_lib.PRESETS:
        config = GPTConfig.from_preset(name)
        with shapes_only():  # real modules, no memory
            model = GPT(config)
        n = model.num_params()
        n_ne = model.num_params(non_embedding=True)
        assert (n, n_ne) == (model_lib.count_params(config), model_lib.count_params(config, True))
        f = model_lib.flops_per_token(config)
        attention = 12 * config.n_layer * config.n_embd * config.block_size / f
        shape = f"{config.n_layer:>3} {config.n_head:>3} {config.n_embd:>5}"
        shape += f" {config.block_size:>5} {config.vocab_size:>6}"
        print(f"{name:<12} {shape} {n:>15,} {n_ne:>15,} {f:>15,} {attention:>9.1%}")
    print("'small' is shown with GPT-2's vocabulary; the timings below use --small-vocab\n")


def make_pair(config, seed):
    torch.manual_seed(seed)
    ours = GPT(config)
    reference = PlainGPT(config)
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def check_same_function(ours, reference, x, y):
    """Same weights in, same logits and loss out (fp32, TF32 off; only the order of sums differs:
    1e-4 relative leaves room for 12 layers of it on a GPU, still far below any real bug)."""
    with torch.no_grad():
        logits, loss = ours(x, y)
        ref_logits, ref_loss = reference(x, y)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    return (logits - ref_logits).abs().max().item()


def bench_preset(name, vocab_size, batch_size, args, dtype_name="fp32"):
    config = GPTConfig.from_preset(name, vocab_size=vocab_size)
    ours, reference = (m.to(args.device) for m in make_pair(config, args.seed))
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, vocab_size, (batch_size, config.block_size + 1), generator=g)
    x = data[:, :-1].to(args.device)
    y = data[:, 1:].to(args.device)
    diff = check_same_function(ours, reference, x, y)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    steps = {}
    for label, model in (("ours", ours), ("reference", reference)):
        fused = args.device.type == "cuda"  # CUDA's fused AdamW, as train.py
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        step = timing.make_step(model, optimizer, dtype)
        steps[label] = lambda step=step: step(x, y)
    times = timing.alternate(steps, args.steps, args.warmup, args.device)
    dt = {label: statistics.median(t) for label, t in times.items()}
    tokens = x.numel()
    flops = model_lib.flops_per_token(config, x.size(1))
    print(f"{name:<6} {dtype_name} B={batch_size:<3} T={config.block_size:<4} V={vocab_size:<5} "
          f"params={ours.num_params():>10,}")
    ours_line = timing.throughput(dt["ours"], tokens, flops, dtype_name, args.device)
    ref_line = timing.throughput(dt["reference"], tokens, flops, dtype_name, args.device)
    print(f"  ours      {ours_line}")
    print(f"  reference {ref_line}")
    speed_up = dt["reference"] / dt["ours"]
    print(f"  speed-up {speed_up:.2f}x   (logits max |diff| {diff:.1e})")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="timed steps per model; the median is reported"
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per model first (allocator, caches)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument(
        "--small-vocab", type=int, default=4096, help="'small's V: a 4,096-token BPE of 01_data.py"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="init and batch seed; runs repeat")
    cuda = torch.cuda.is_available()
    parser.add_argument(
        "--device", default="cuda" if cuda else "cpu", help="cpu: tiny, small; cuda: GPT-2 124M"
    )
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    print_presets()
    steps = f"median of {args.steps} training steps (forward + backward + AdamW)"
    print(timing.machine(f"{steps} on {args.device}"))
    if args.device.type == "cuda":  # GPT-2's own vocabulary, 50,257 rows (unpadded, as HF's)
        for dtype_name in ("fp32", "bf16"):
            bench_preset("gpt2", 50257, args.batch_size, args, dtype_name)
    else:
        bench_preset("tiny", 256, args.batch_size, args)
        bench_preset("small", args.small_vocab, args.batch_size, args)
    print("speed-up = reference step time / our step time (> 1: ours is faster)")
    print("TFLOP/s = tokens/s x flops_per_token(config, T): the model FLOP/s of the step")


if __name__ == "__main__":
    main()
