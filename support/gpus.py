"""The peak FLOP/s of GPUs, MFU's denominator: train.py's logs and the benchmarks read it here.

MFU (model FLOPs utilisation, PaLM, arXiv 2204.02311) = achieved model FLOP/s / the devices' peak.
train.py counts 02_model.flops_per_token per token; this file says what the hardware could do.
Run as a script: prints the table.
"""

import os
import re
import sys

# Dense peak FLOP/s per GPU (tensor cores, without the 2:4 sparsity doubling datasheets print next
# to them; fp16/bf16 with fp32 accumulation, as PyTorch uses). Key: a piece of
# torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3". Sources: NVIDIA datasheets (V100,
# A100, H100, H200, L4, T4) and whitepapers (GA102 appendix A: RTX 3090; Ada: RTX 4090). subtle:
# NVIDIA publishes no A10G (AWS G5) datasheet; its row is the commonly quoted 70/35 TFLOP/s, which
# public bf16 matmul measurements (~69) support, not the A10's 125: the least certain row.
PEAK_FLOPS = {
    "V100-SXM2": {"fp16": 125e12, "fp32": 15.7e12},  # Volta: no bf16, no tf32
    "V100-PCIE": {"fp16": 112e12, "fp32": 14e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},  # Turing: no bf16, no tf32
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},  # 40 and 80 GB
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 35e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "H100": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM
    "H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
    "H200": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM
}


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one `device_name` GPU in `dtype` ("bf16", "fp16", "tf32", "fp32"),
    or None when the card or dtype is not in PEAK_FLOPS: an unknown peak is never guessed."""
    # words that mark a different card with other peaks ("H100 NVL", "RTX 3090 Ti", "RTX 4090 D",
    # a laptop part): a name with one of these only matches a key that names it too
    variants = {"nvl", "ti", "super", "d", "laptop", "mobile", "max"}
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # most specific first: "H100 PCIe"
        key_words = re.findall(r"[a-z0-9]+", key.lower())  # whole words: "L4" is not "L40S"
        if any(words[i : i + len(key_words)] == key_words for i in range(len(words))):
            other_card = (set(words) - set(key_words)) & variants
            return None if other_card else PEAK_FLOPS[key].get(dtype)
    return None


def mfu(tokens_per_s, flops_per_token, n_devices, peak_flops_per_device) -> float | None:
    """MFU: achieved model FLOP/s (tokens_per_s: global) over all devices' peak; None if unknown."""
    if peak_flops_per_device is None:
        return None
    return tokens_per_s * flops_per_token / (n_devices * peak_flops_per_device)


def recompute_flops_per_token(config, seq_len: int, mode: str) -> int:
    """The FLOPs per token that recomputation adds (HFU counts them, MFU does not). Full redoes
    each block's forward: 2 FLOPs per matmul weight (12C² a block) and attention's q k^T and
    att @ v, 4·nh·hs·T. Selective redoes no weight's matmul, but with dropout on it redoes
    attention (02 keeps no output that drew random numbers); its elementwise ops are left out,
    as in 02's count."""
    C, L, attention = config.n_embd, config.n_layer, 4 * config.n_head * config.head_dim * seq_len
    if mode == "full":  # mode: "none" | "selective" | "full", as 06b's recomputation
        return L * (2 * 12 * C * C + attention)
    return L * attention if mode == "selective" and config.dropout > 0 else 0


def machine() -> str:
    """What a benchmark ran on, for its printout: the GPU's name if one is used, else the CPU's
    model name; the CPU count and torch's version."""
    import platform

    import torch

    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    return f"{name}, {os.cpu_count()} CPUs, torch {torch.__version__}"


if __name__ == "__main__":
    for card, peaks in PEAK_FLOPS.items():
        print(f"{card:<10} " + "  ".join(f"{k} {v / 1e12:6.1f} TFLOP/s" for k, v in peaks.items()))
    if len(sys.argv) > 1:  # a device name, as torch.cuda.get_device_name() gives it
        print(
            sys.argv[1], {d: peak_flops(sys.argv[1], d) for d in ("bf16", "fp16", "tf32", "fp32")}
        )
