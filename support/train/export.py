"""model.pt, the exported model: merged from a checkpoint's shards, written, sampled.

model.pt holds the model's config and state dict (02_model.GPT's), the step, and the
tokenizer: a name ("gpt2", "char") or a trained BPE's vocabulary, merges and special
tokens, so that it samples from any folder. This file knows the files; train.py builds
the model. The weights are read from the checkpoint's pieces (support/train/checkpoint),
whatever layout wrote them. Its vocabulary is padded to a multiple of 64 rows, whatever
tp trained it (support/train/vocab).
"""

from dataclasses import asdict
from pathlib import Path

import torch

from support.files import atomic_write
from support.train.checkpoint import read_files, read_newest, whole
from support.train.vocab import trim_rows


def merge_shards(state_dicts, tp_layout, merge_tensors) -> dict:
    """The TP ranks' state dicts, in tp_rank order -> the full one.

    `tp_layout(key)` says how 04 split a tensor (None: replicated), and
    `merge_tensors(shards, *layout)` joins its shards back.
    """
    full = {}
    for key, value in state_dicts[0].items():
        layout = tp_layout(key)
        if layout:
            value = merge_tensors([sd[key] for sd in state_dicts], *layout)
        full[key] = value
    return full


def read_model(ckpt) -> tuple[dict, dict]:
    """A checkpoint folder -> (its meta.json, the whole model's state dict).

    Each weight is read on the CPU, one at a time, from the pieces that hold it (its
    TP cuts, its ZeRO ranges: the slice map in meta.json, support/train/checkpoint);
    only the files that hold weights are opened, memory-mapped, so AdamW's moments
    beside them are never read. The tied lm_head.weight is wte's tensor, as in 02's
    state dict.
    """

    def weights(meta):  # The files that hold a piece of a weight.
        files = set()
        for (_, state), pieces in meta["index"].items():
            if state == "param":
                files.update(pc["file"] for pc in pieces)
        return files

    shard = read_files(ckpt, weights)
    full = {}
    for name, state in shard["index"]:
        if state == "param":
            full[name] = whole(shard, name)
    if shard["model_config"].get("tie_embeddings"):
        full["lm_head.weight"] = full["transformer.wte.weight"]
    return shard, full


def export(run_dir, fold_lora, build_model, get_tokenizer):
    """Assemble the newest readable checkpoint's weights into RUN_DIR/model.pt.

    The lessons' parts come in: 02's `fold_lora(state_dict, scale)` (merge_lora),
    `build_model(config)` (a plain GPT from a config dict) and 01's `get_tokenizer`.
    """
    meta, full = read_newest(run_dir, read_model)
    config = meta["config"]
    if config.get("lora_rank"):  # LoRA's factors folded in: W + (alpha / r)·B·A.
        full = fold_lora(full, config["lora_alpha"] / config["lora_rank"])
    # TP's padding rows (64·tp, zero) cut to 64: model.pt is alike at every tp.
    full, model_config = trim_rows(full, meta["model_config"])
    model = build_model(model_sizes(model_config))
    model.load_state_dict(full, strict=True)  # Every weight present, none left over.
    tokenizer = tokenizer_blob(meta["tokenizer"], get_tokenizer)
    return write_model_pt(Path(run_dir) / "model.pt", model, meta["step"], tokenizer)


def tokenizer_blob(name: str, get_tokenizer):
    """The tokenizer as model.pt stores it: a name, or a BPE's vocab, merges, specials.

    `get_tokenizer` is 01_data's: it reads a saved BPE from its path.
    """
    if name in ("gpt2", "char"):
        return name
    tok = get_tokenizer(name)
    specials = list(tok.special_tokens)
    return {"vocab": tok.vocab, "merges": tok.merges, "special_tokens": specials}


def write_model_pt(out, model, step: int, tokenizer):
    """A plain model (with `.config`, a dataclass) -> model.pt at `out`, atomically."""
    blob = {
        "model_config": asdict(model.config),
        "model": model.state_dict(),
        "step": step,
    }
    blob["tokenizer"] = tokenizer
    atomic_write(out, lambda tmp: torch.save(blob, tmp))
    return out


def model_sizes(model_config: dict) -> dict:
    """A saved model config without "recompute", which GPTConfig no longer has.

    Older checkpoints and model.pt files saved a recompute mode in the model's config.
    It is a training choice, not part of the model, so it is dropped here.
    """
    return {k: v for k, v in model_config.items() if k != "recompute"}


def load_exported(path, build_model) -> tuple:
    """model.pt -> (`build_model(its config dict)` with its weights, the blob)."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(model_sizes(blob["model_config"]))
    model.load_state_dict(blob["model"])
    return model, blob


def generate_text(model, tokenizer, prompt: str, n_tokens: int, seed: int = 0) -> str:
    """The prompt and n_tokens sampled after it (temperature 0.8, top 50), decoded."""
    idx = torch.tensor([tokenizer.encode(prompt) or [tokenizer.eot_token]])
    # --vocab-size above the tokenizer's ids: 02's generate samples below vocab_size,
    # so the rows no token has are never sampled (this model is the caller's to sample).
    model.config.vocab_size = min(tokenizer.n_vocab, model.config.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(idx, n_tokens, temperature=0.8, top_k=50, generator=generator)
    return tokenizer.decode(out[0].tolist())


def to_hf_state_dict(model) -> dict:
    """A plain GPT's weights in Hugging Face's GPT-2 layout: the inverse of
    GPT.from_hf_state_dict, for --init-from's tests and benchmarks.

    GPT2LMHeadModel's keys; Conv1D weights (type(model)._CONV1D) back to (in, out); the
    padding rows of wte and lm_head dropped. No attn.bias mask buffers: Hugging Face's
    newer versions do not save them.
    """
    V = model.config.vocab_size
    conv1d = type(model)._CONV1D
    sd = {}
    for key, value in model.state_dict().items():
        value = value.detach()
        if key.endswith(conv1d):
            value = value.t()
        if key in ("transformer.wte.weight", "lm_head.weight"):
            value = value[:V]
        sd[key] = value.contiguous().clone()
    return sd
