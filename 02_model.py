"""02 · The GPT: token ids go in, next-token logits come out.

The idea in one sentence: a GPT is a stack of identical blocks, each reading a
"residual stream" (one C-wide vector per token) and adding back what attention gathered
from earlier tokens and what an MLP made of that; then one linear layer reads the
stream as scores (logits) over the vocabulary.

The shape legend, used in every file of this course:
    B   batch: sequences per (micro)batch      T   time: sequence length <= block_size
    C   n_embd: width of the residual stream   nh  n_head: attention heads
    hs  head size = C / nh                     V   vocabulary (V_padded: see the config)
    L   n_layer: blocks
Later lessons add the split to the shape: (B, T, C/tp) is one rank's slice.

The math (GPT-2: Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners"):
    x = wte[idx] + wpe[0..T-1]                  (B, T, C)  token + learned position
    for each of the L blocks (pre-LayerNorm: normalise a branch's input, not x):
        x = x + Attn(LN_1(x))                   (B, T, C)
        x = x + MLP(LN_2(x))                    (B, T, C)
    logits = LN_f(x) @ wte^T                    (B, T, V)  output matrix tied to wte
    Attn:  [q | k | v] = LN(x) W_attn, each (B, T, C), split into nh heads of hs
           y_h = softmax(q_h k_h^T / sqrt(hs) + M) v_h, M[i, j] = -inf where j > i
           Attn(x) = concat_h(y_h) W_o
    MLP:   MLP(x) = GELU(x W_fc + b_fc) W_proj + b_proj, hidden width 4C, tanh-GELU
    Loss:  mean over positions of -log softmax(logits)[next token]; ln(V) if uniform.

One Block (attention through F.scaled_dot_product_attention: a flash-attention kernel):

    x (B, T, C)   the residual stream
    │
    ├──▶ ln_1 ──▶ c_attn ──▶ [q|k|v] (B, T, 3C) ──▶ split heads: 3 x (B, nh, T, hs)
    │                                                   │
    │                                                   ▼ causal attention
    │                                                   │
    │    (B, T, C) ◀── c_proj ◀── merge heads ◀── (B, nh, T, hs)
    │        │
    (+)◀─────┘
    │
    ├──▶ ln_2 ──▶ c_fc (B, T, 4C) ──▶ GELU ──▶ c_proj (B, T, C)
    │                                              │
    (+)◀───────────────────────────────────────────┘
    │
    x (B, T, C)   on to the next block; after the last one: ln_f, lm_head -> (B, T, V)

Counting: 6N + 12·L·nh·hs·T training FLOPs per token (PaLM, Chowdhery et al. 2022,
arXiv 2204.02311, Appendix B): flops_per_token. bench/bench_model.py times the step.

Run it:  python 02_model.py   (seconds on a CPU; --help for flags). It prints the
presets' sizes and FLOPs per token, overfits a tiny model on one batch, and samples.

What changed from 01b_cleaning.py: the ids that 01 and 01b prepare become logits and a
loss here. The demo's tokens are raw bytes (V = 256, from byte_batches, which later
demos reuse). Names match nanoGPT and Hugging Face (transformer.h.0.attn.c_attn, ...),
so GPT-2's weights load exactly; LoRA, at the end of the file, fine-tunes them.

Left out on purpose: techniques that change how the model runs are applied from their
own lessons (parallelism, mixed precision, activation recomputation); so are the
optimizer, the schedule, checkpoints, MFU and torch.compile (train.py), and a KV cache.
"""

import argparse
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from support.meta import shapes_only

DEMO_CORPUS = Path(__file__).resolve().parent / "support" / "frozen_corpus.txt"


# ------------------------------------------------------------ config
@dataclass
class GPTConfig:
    block_size: int = 1024  # longest context T; GPT-2 learned 1024 positions
    vocab_size: int = 50257  # GPT-2's BPE: 256 bytes + 50,000 merges + <|endoftext|>
    n_layer: int = 12  # GPT-2 small (124M); bigger sizes are presets below
    n_head: int = 12  # hs = 768 / 12 = 64, the head size of every GPT-2
    n_embd: int = 768
    dropout: float = 0.0  # GPT-2 used 0.1; pretraining on plenty of data needs none
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm (to load its weights)
    tie_embeddings: bool = True  # lm_head shares wte (Press & Wolf 2017): V*C fewer
    pad_vocab_multiple: int = 1  # 1 keeps HF's shapes; 64 (50257 -> 50304) is faster

    def __post_init__(self):
        names = "block_size vocab_size n_layer n_head n_embd pad_vocab_multiple"
        for name in names.split():
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"GPTConfig.{name} must be a positive integer, got {value!r}"
                )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab_size(self) -> int:
        """The rows wte really has: vocab_size rounded up to pad_vocab_multiple."""
        multiple = self.pad_vocab_multiple
        return -(-self.vocab_size // multiple) * multiple

    @property
    def head_dim(self) -> int:  # hs
        return self.n_embd // self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """GPTConfig.from_preset("small", vocab_size=256): a size, then overrides."""
        if name not in PRESETS:
            valid = ", ".join(PRESETS)
            raise ValueError(f"unknown preset {name!r}; valid presets: {valid}")
        return cls(**{**PRESETS[name], **overrides})


_GPT2 = dict(block_size=1024, vocab_size=50257)
# tiny: the tests (about 35 thousand parameters, milliseconds; V = 256, raw bytes);
# small: the CPU main job (V from the tokenizer); then the four published GPT-2 sizes.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256),
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, **_GPT2),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, **_GPT2),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, **_GPT2),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, **_GPT2),
}


# ------------------------------------------------------------ the model
class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.c_attn = nn.Linear(C, 3 * C, bias=config.bias)  # fused q, k, v: one matmul
        self.c_proj = nn.Linear(C, C, bias=config.bias)  # W_o; a residual projection
        self.resid_dropout = nn.Dropout(config.dropout)
        self.head_dim = config.head_dim  # hs
        self.dropout = config.dropout  # on the attention probabilities

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.c_attn(x)  # (B, T, 3C): [q | k | v], heads contiguous inside each
        # subtle: the head count comes from the tensor, never from config.n_head, so
        # this same code runs on a tensor-parallel rank that holds some of the heads.
        heads = (t.view(B, T, -1, self.head_dim) for t in qkv.chunk(3, dim=-1))
        q, k, v = (t.transpose(1, 2) for t in heads)  # 3 x (B, nh, T, hs)
        # softmax(q k^T / sqrt(hs), causal) v; on a GPU one fused flash kernel, which
        # never stores the (B, nh, T, T) scores.
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.c_fc = nn.Linear(C, 4 * C, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * C, C, bias=config.bias)  # a residual projection
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C): tokens talk to earlier tokens
        return x + self.mlp(self.ln_2(x))  # (B, T, C): each token thinks on its own


def cross_entropy_loss(logits, targets, reduction="mean", *, vocab_size=None):
    """Next-token cross-entropy in fp32 of (B, T, V) logits and (B, T) targets.

    Targets of -1 are ignored. reduction="sum" lets a caller divide by its own token
    count (gradient accumulation does). Padding columns (>= vocab_size) are masked:
    GPT-2's real logits sit far below 0, so a padding column near 0 would win."""
    V = logits.size(-1)
    pad = vocab_size is not None and vocab_size < V  # padding columns: never a target
    # fp32 for the softmax's long sums; with padding, our own copy (under autocast
    # .float() makes one anyway), so the caller's logits stay unchanged.
    flat = logits.to(torch.float32, copy=pad).reshape(-1, V)  # (B*T, V)
    if pad:
        flat[:, vocab_size:] = -math.inf
    flat_targets = targets.reshape(-1)  # (B*T,)
    return F.cross_entropy(flat, flat_targets, ignore_index=-1, reduction=reduction)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        C = config.n_embd
        V = config.padded_vocab_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(
                    V, C
                ),  # rows >= vocab_size are padding: never an input
                wpe=nn.Embedding(config.block_size, C),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(C, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(C, V, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # one (V, C) tensor
        self.loss_fn = functools.partial(
            cross_entropy_loss, vocab_size=config.vocab_size
        )
        self._init_weights()

    def _init_weights(self):
        """GPT-2's init: N(0, 0.02) weights, zero biases, and the residual projections
        at 0.02/sqrt(2L) (two adds per block, so the stream's variance stays O(1)). One
        seed gives one model on every rank. nn.init runs without autograd."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if (
                isinstance(module, (nn.Linear, nn.LayerNorm))
                and module.bias is not None
            ):
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=residual_std)

    # The forward in three pieces, so that later lessons can shard or cut the model
    # without rewriting it.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C): token + position embedding, then dropout."""
        B, T = idx.shape
        n = self.config.block_size
        assert T <= n, f"T={T} exceeds block_size={n}: crop the input"
        positions = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        return self.transformer.drop(x)  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final LayerNorm, then lm_head: (B, T, C) @ (C, V) -> (B, T, V_padded)."""
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, idx, targets=None, reduction="mean"):
        """(B, T) ids [, (B, T) targets] -> ((B, T, V_padded) logits, loss or None)."""
        x = self.embed(idx)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        logits = self.head(x)  # (B, T, V_padded)
        if targets is None:
            return logits, None
        return logits, self.loss_fn(logits, targets, reduction)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, a tied wte/lm_head counted once. non_embedding=True drops the
        lookup tables (wpe, and wte when untied) but keeps the output head: the N of the
        FLOP count, as GPT-2's."""
        n = sum(p.numel() for p in self.parameters())  # a shared tensor comes once
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
            if self.lm_head.weight is not self.transformer.wte.weight:
                n -= self.transformer.wte.weight.numel()
        return n

    @torch.no_grad()
    def generate(
        self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None
    ):
        """idx (B, T0) -> (B, T0 + max_new_tokens), each id sampled (greedy at
        temperature 0) from the last block_size ids and never a padding id; the model
        runs in eval mode, and its old mode comes back."""
        if temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(
                f"need temperature >= 0 and top_k >= 1, got {temperature}, {top_k}"
            )
        was_training = self.training
        V = self.config.vocab_size
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.config.block_size :])  # (B, T, V_padded)
                logits = logits[
                    :, -1, :V
                ].float()  # (B, V): the last position, real ids
                next_id = self._pick(logits, temperature, top_k, generator)  # (B, 1)
                idx = torch.cat((idx, next_id), dim=1)
        finally:
            self.train(was_training)
        return idx

    @staticmethod
    def _pick(logits, temperature, top_k, generator):  # (B, V) logits -> (B, 1) ids
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[
                :, -1:
            ]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator)

    # -------------------------------------------------------------- Hugging Face GPT-2
    # subtle: HF's GPT-2 uses Conv1D, not nn.Linear: x @ W + b with W stored as
    # (in, out), where nn.Linear computes x @ W^T + b with W as (out, in). So these four
    # weights are transposed.
    _CONV1D = (
        "attn.c_attn.weight",
        "attn.c_proj.weight",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
    )

    @classmethod
    def from_hf_state_dict(cls, state_dict, n_head: int | None = None) -> "GPT":
        """A GPT from a Hugging Face GPT-2 state dict (GPT2Model or GPT2LMHeadModel).

        The config is read off the shapes (V and C from wte, block_size from wpe, L by
        counting blocks, bias if biases exist), except the head count: pass n_head, or
        get GPT-2's C // 64."""
        sd = {k.removeprefix("transformer."): v for k, v in state_dict.items()}
        masks = (".attn.bias", ".attn.masked_bias")  # HF's causal-mask buffers
        sd = {k: v for k, v in sd.items() if not k.endswith(masks)}
        sd = {k: v.t() if k.endswith(cls._CONV1D) else v for k, v in sd.items()}
        V, C = sd["wte.weight"].shape
        blocks = {int(m.group(1)) for k in sd if (m := re.match(r"h\.(\d+)\.", k))}
        head = sd.pop("lm_head.weight", None)
        config = GPTConfig(
            block_size=sd["wpe.weight"].shape[0],
            vocab_size=V,
            n_layer=len(blocks),
            n_head=n_head or C // 64,
            n_embd=C,
            bias="h.0.attn.c_attn.bias" in sd,
            tie_embeddings=head is None or torch.equal(head, sd["wte.weight"]),
        )
        ours = {f"transformer.{k}": v for k, v in sd.items()}
        ours["lm_head.weight"] = sd["wte.weight"] if config.tie_embeddings else head
        model = cls(config)
        model.load_state_dict(ours, strict=True)  # copies; errors name the bad keys
        return model

    @classmethod
    def load_pretrained(cls, path, n_head: int | None = None) -> "GPT":
        """GPT-2 from a .bin/.pt/.pth/.safetensors file or a HF snapshot folder (whose
        config.json gives n_head)."""
        path = Path(path)
        if path.is_dir():
            if n_head is None and (path / "config.json").exists():
                n_head = json.loads((path / "config.json").read_text()).get("n_head")
            files = [path / n for n in ("model.safetensors", "pytorch_model.bin")]
            # with neither file present, torch.load below names the missing one
            path = next((f for f in files if f.exists()), files[1])
        if path.suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError as e:  # optional: not a dependency of this course
                raise ImportError(
                    f"{path}: pip install safetensors, or use a .bin"
                ) from e
            state_dict = load_file(str(path))
        elif path.suffix in (".bin", ".pt", ".pth"):
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise ValueError(
                f"unknown checkpoint format {path.suffix!r}: use .bin or .safetensors"
            )
        return cls.from_hf_state_dict(state_dict, n_head=n_head)


# ------------------------------------------------------------ counting
def count_params(config: GPTConfig, non_embedding: bool = False) -> int:
    """GPT.num_params from the config, with no memory: the module is built on the meta
    device. Per block 12C² weights (c_attn C x 3C, attn.c_proj C x C, c_fc C x 4C,
    mlp.c_proj 4C x C) and 13C biases and gains. GPT-2:
    12·(12·768² + 13·768) + (50257 + 1024 + 2)·768 = 124,439,808."""
    with shapes_only():  # the meta device: shapes, no memory, nothing drawn
        return GPT(config).num_params(non_embedding)


def flops_per_token(config: GPTConfig, seq_len: int | None = None, lora_rank=0) -> int:
    """Training FLOPs per token, forward + backward: 6N + 12·L·H·Q·T (PaLM, Appendix B).

    6N: each weight does one multiply-add (2 FLOPs) per token in the forward and twice
        that in the backward (gradients for the input and for the weight): 2N + 4N.
    12·L·H·Q·T: attention's weightless matmuls q k^T and (scores) v, 2·T·Q FLOPs each
        per head and token forward, x3 with the backward. L layers, H heads, Q = hs.
    N = GPT.num_params(non_embedding=True): every weight that multiplies a token, the
    tied head included, not wpe (a lookup), as nanoGPT and PaLM count. T is the whole
    sequence, as PaLM counts, though causal masking needs about half of that work.
    lora_rank r > 0 (apply_lora, below): no frozen weight's own gradient (2N less, its
    input's stays), and all 6 for each factor number, r·(in + out) for each of
    LORA_TARGETS' linears: (4 + 2 + 5 + 5)·r·C = 16·r·C a block."""
    T = seq_len or config.block_size
    N = count_params(config, non_embedding=True)
    factors = 16 * lora_rank * config.n_embd * config.n_layer  # LoRA's trained numbers
    weights = 4 * N + 6 * factors if lora_rank else 6 * N
    return weights + 12 * config.n_layer * config.n_head * config.head_dim * T


def recompute_flops_per_token(config: GPTConfig, seq_len: int, mode: str) -> int:
    """The FLOPs per token that recomputation (06b's mode: "none" | "selective" |
    "full") adds: HFU counts them, MFU does not. Full redoes each block's forward: 2
    FLOPs per matmul weight (12C² a block) and attention's q k^T and att @ v, 4·nh·hs·T.
    Selective redoes no weight's matmul, but with dropout on it redoes attention (02
    keeps no output that drew random numbers); elementwise ops are left out, as above."""
    C = config.n_embd
    L = config.n_layer
    attention = 4 * config.n_head * config.head_dim * seq_len
    if mode == "full":
        return L * (2 * 12 * C * C + attention)
    return L * attention if mode == "selective" and config.dropout > 0 else 0


# ------------------------------------------------------------ demo data
def byte_batches(
    block_size: int, batch_size: int, steps: int = 1, seed: int = 0, device="cpu"
):
    """A list of `steps` batches (x, y) of random windows of support/frozen_corpus.txt.

    Each is (B, T) int64 byte values (V = 256: no tokenizer needed), y is x moved on by
    one byte, and every tensor has its own storage. Every demo trains on these: the
    corpus is a frozen copy of some Python source, not a lesson's own text, so that
    editing a lesson never changes the numbers the demos print; the same seed gives
    the same batches."""
    data = torch.frombuffer(bytearray(DEMO_CORPUS.read_bytes()), dtype=torch.uint8)
    data = data.long()  # (n,)
    T = block_size
    assert len(data) > T + 1, (
        f"block_size={T} needs more than {len(data)} bytes of text"
    )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(
        len(data) - T, (steps, batch_size), generator=g
    )  # (steps, B)
    rows = data[starts[..., None] + torch.arange(T + 1)]  # (steps, B, T+1)
    batches = []
    for r in rows:  # clone: a new storage, even when B = 1
        x = r[:, :-1].clone(memory_format=torch.contiguous_format)
        y = r[:, 1:].clone(memory_format=torch.contiguous_format)
        batches.append((x.to(device), y.to(device)))
    return batches


# ------------------------------------------------------------ LoRA
# LoRA wraps the model from outside, yet lives here, with the weights it fine-tunes:
# tensor parallelism must shard its factors and may import only lower-numbered files.
# Hu et al. 2021 (arXiv 2106.09685): W frozen, y = x W^T + b + (alpha/r)·(x A^T) B^T,
# A (r, in) random and B (out, r) zero, so it starts as the base model; r·(in + out)
# numbers train per linear (AdamW keeps 2·r·(in + out) moments, not 2·in·out), and
# merge_lora folds B·A into W for export.
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        # The base's own (frozen) weight and bias: the state dict's keys stay a GPT's.
        self.weight = base.weight  # W: (out, in)
        self.bias = base.bias
        self.scale = alpha / rank
        n_out, n_in = base.weight.shape
        self.lora_A = nn.Parameter(base.weight.new_empty(rank, n_in))  # (r, in)
        self.lora_B = nn.Parameter(base.weight.new_zeros(n_out, rank))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's, as peft's

    def forward(self, x):
        """(B, T, in) -> (B, T, out), the update through the (B, T, r) bottleneck."""
        low_rank = x @ self.lora_A.T @ self.lora_B.T  # (B, T, r) -> (B, T, out)
        return F.linear(x, self.weight, self.bias) + low_rank * self.scale


def apply_lora(model: GPT, rank: int, alpha: float, targets=LORA_TARGETS) -> GPT:
    """Freeze every weight, then wrap each block's `targets` linears with LoRA factors,
    in place."""
    model.requires_grad_(False)
    for block in model.transformer.h:
        for name in targets:
            parent, _, attr = name.rpartition(".")
            owner = block.get_submodule(parent)
            setattr(owner, attr, LoRALinear(getattr(owner, attr), rank, alpha))
    return model


def merge_lora(state_dict: dict, scale: float) -> dict:
    """A LoRA model's state dict -> a plain GPT's: W + scale·B·A, the factors dropped."""
    factors = (".lora_A", ".lora_B")
    sd = {k: v for k, v in state_dict.items() if not k.endswith(factors)}
    for key in (k for k in state_dict if k.endswith(".lora_A")):
        weight = key.removesuffix("lora_A") + "weight"
        lora_B = key.removesuffix("A") + "B"
        # a new tensor for W: the model's own stays unchanged
        sd[weight] = sd[weight] + scale * state_dict[lora_B] @ state_dict[key]
    return sd


# ------------------------------------------------------------ the demo
def print_presets():
    """Each preset's parameters (the module, on the meta device) and FLOPs per token."""
    print(f"{'preset':<12} {'params':>14} {'non-embedding':>14} {'FLOPs/token':>15}")
    for name in PRESETS:
        config = GPTConfig.from_preset(name)
        n = count_params(config)
        n_ne = count_params(config, non_embedding=True)
        print(f"{name:<12} {n:>14,} {n_ne:>14,} {flops_per_token(config):>15,}")
    # wte stays in N: tied, it is also the head, a matmul every token pays.
    print("FLOPs/token = 6N + 12·L·nh·hs·T, N: all parameters but wpe (the positions)\n")


def overfit_demo(model: GPT, x, y, args):
    """Train on one batch only: the loss falls from ln(V) toward 0 (memorisation)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ln_v = math.log(model.config.vocab_size)
    print(
        f"overfitting one batch {tuple(x.shape)} of bytes, {model.num_params():,} "
        f"parameters: the loss falls from ln V = {ln_v:.4f} toward 0"
    )
    for step in range(args.steps + 1):
        _, loss = model(x, y)  # the loss after `step` updates
        if step % max(args.steps // 5, 1) == 0 or step == args.steps:
            # Two significant digits: lr 1e-2 makes the run chaotic, and the CPU's
            # kernels (ATEN_CPU_CAPABILITY) moved step 30's loss by 1e-4, in fp64 too.
            print(f"step {step:4d}  loss {loss.item():#.2g}")
        if step < args.steps:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def sample_demo(model: GPT, x, args):
    """From the first 8 bytes of row 0, a model that memorised it recites the rest."""
    prompt = x[:1, :8]
    T = x.size(1)
    for temperature in (0.0, 1.0):
        g = torch.Generator(device=x.device).manual_seed(args.seed)
        out = model.generate(
            prompt, T - 8, temperature=temperature, top_k=50, generator=g
        )
        text = bytes(out[0].tolist()).decode(errors="replace")
        recites = torch.equal(out, x[:1])
        print(
            f"generate(temperature={temperature}): {text!r}  recites the row: {recites}"
        )


def main(argv=None):
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=formatter
    )
    add = parser.add_argument
    add("--preset", default="tiny", choices=("tiny", "small"), help="model size")
    add("--batch-size", type=int, default=4, help="rows of the one batch to learn")
    add("--steps", type=int, default=150, help="AdamW steps")
    add("--lr", type=float, default=1e-2, help="AdamW's; high: memorising is easy")
    add("--seed", type=int, default=1337, help="seeds everything; runs repeat")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    add("--device", default=device, help="where it runs; a GPU when there is one")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error(
            f"--steps {args.steps} and --batch-size {args.batch_size}: each must be >= 1"
        )
    print_presets()
    torch.manual_seed(args.seed)
    config = GPTConfig.from_preset(args.preset, vocab_size=256)  # tokens are bytes here
    model = GPT(config).to(args.device)
    T = config.block_size
    [(x, y)] = byte_batches(T, args.batch_size, seed=args.seed, device=args.device)
    overfit_demo(model, x, y, args)
    sample_demo(model, x, args)


if __name__ == "__main__":
    main()
