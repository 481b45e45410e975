"""The one GPU table: each card's datasheet figures, its measured calibration, one name
matcher. MFU's denominator (train.py's logs, the benchmarks) and 09_plan.py's machines.

MFU (model FLOPs utilisation, PaLM, arXiv 2204.02311) = achieved model FLOP/s / the
devices' peak. train.py counts 02_model.flops_per_token per token; this file says what the
hardware could do. Peaks are dense (no 2:4 sparsity doubling), fp16/bf16 with fp32
accumulation, as PyTorch uses. Bandwidths are per GPU and per direction, in bytes/s:
NVLink's "900 GB/s" on a datasheet is both directions together, 450 GB/s each way. Memory
is what the card reports (nvidia-smi's MiB), not the datasheet's round "80 GB"; torch's
total_memory reports a few hundred MiB less, which 09's 90% margin covers. No network
here: every figure is cited from the datasheet or printout named in its row's comment,
as published, not fetched. The "cpu" row is this project's 2-core VM, an estimate said
as one. Rows without memory (an older or a desktop card) give MFU only:
09 cannot plan them.

The step's time on a GPU is a roofline, each part at that GPU's own limit (09_plan.py sums
it): the matmuls at a share e(C) of the peak that rises with the width C, attention at its
own share, the memory-bound kernels (LayerNorm, GELU, residual adds, casts, the loss's
softmax, the optimizer) as bytes over the HBM bandwidth, collectives over the links.
ROOFLINE holds the constants, each with the measurement it comes from.
Run as a script: prints the table; `python support/gpus.py NAME` matches a device name.
"""

import os
import re
import sys
from dataclasses import dataclass

GB = 1e9
TB = 1e12
MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator of a node, and the links out of it."""

    name: str  # The words a device name must hold (the matcher's key): "A100 40GB".
    flops: dict  # Dense peak FLOP/s by dtype: "bf16", "fp16", "tf32", "fp32".
    memory: float | None = None  # Bytes of device memory as the card reports them.
    hbm: float | None = None  # Device memory bandwidth, bytes/s.
    nvlink: float | None = None  # Bytes/s one way to a GPU of the same node.
    network: float | None = None  # Bytes/s one way to another node (its NIC share).
    watts: float | None = None  # Board power (TDP) at full load; None: unknown.
    source: str = ""


def _peaks(bf16, tf32, fp32) -> dict:
    """A tensor-core card's dense peaks: fp16 runs at bf16's rate."""
    return {"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32}


# Keys are 09's --gpu names. A10G: NVIDIA publishes no datasheet (AWS G5); its row is the
# commonly quoted 70/35 TFLOP/s, which public bf16 matmul measurements (~69) support, not
# the A10's 125: the least certain row. Volta and Turing have no bf16 and no tf32.
GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989.5 dense bf16 = 1,979 sparse / 2,
    # 67 fp32, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s, up to 700 W); DGX H100
    # datasheet: 8x 400 Gb/s NDR a node. 81,559 MiB: nvidia-smi in NVIDIA/nccl issue 1264.
    "h100": GPU(
        "H100",
        _peaks(989.5e12, 494.5e12, 67e12),
        81_559 * MIB,
        3.35 * TB,
        450 * GB,
        50 * GB,
        700.0,
        "NVIDIA H100 datasheet (SXM5); DGX H100 datasheet",
    ),
    # The same datasheet, H100 PCIe: 756.5 dense bf16, 51 fp32, 80 GB HBM2e at 2.0 TB/s,
    # 300-350 W; no NVSwitch: GPUs reach each other over PCIe Gen5 x16, 128 GB/s both
    # ways (an NVLink bridge joins pairs only): 64 GB/s one way is the raw rate, ~50
    # achievable after the protocol's overhead (not measured). 81,559 MiB and 350 W:
    # nvidia-smi printouts of the card. Network: one 400 Gb/s NIC a GPU assumed, as DGX
    # H100.
    "h100-pcie": GPU(
        "H100 PCIe",
        _peaks(756.5e12, 378e12, 51e12),
        81_559 * MIB,
        2.0 * TB,
        64 * GB,
        50 * GB,
        350.0,
        "NVIDIA H100 datasheet (PCIe); PCIe Gen5 x16 between GPUs",
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM: H100's peaks, 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s, up to 700 W); DGX H200: 8x 400 Gb/s NDR. 143,771 MiB:
    # this project's H200 (docs/results.md).
    "h200": GPU(
        "H200",
        _peaks(989.5e12, 494.5e12, 67e12),
        143_771 * MIB,
        4.8 * TB,
        450 * GB,
        50 * GB,
        700.0,
        "NVIDIA H200 datasheet (SXM); DGX H200 datasheet",
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 312 bf16, 19.5 fp32, HBM2e
    # 2,039 GB/s, NVLink 600 GB/s, 400 W); DGX A100: 8x 200 Gb/s HDR. 81,920 MiB: the
    # table in modal-labs/modal-client pull 2797.
    "a100": GPU(
        "A100",
        _peaks(312e12, 156e12, 19.5e12),
        81_920 * MIB,
        2.039 * TB,
        300 * GB,
        25 * GB,
        400.0,
        "NVIDIA A100 datasheet (SXM4 80GB); DGX A100 datasheet",
    ),
    # The same datasheet, SXM4 40GB: the same peaks and links, HBM2 at 1,555 GB/s.
    # 40,960 MiB: nvidia-smi printouts of "NVIDIA A100-SXM4-40GB".
    "a100-40gb": GPU(
        "A100 40GB",
        _peaks(312e12, 156e12, 19.5e12),
        40_960 * MIB,
        1.555 * TB,
        300 * GB,
        25 * GB,
        400.0,
        "NVIDIA A100 datasheet (SXM4 40GB); DGX A100 datasheet",
    ),
    # NVIDIA Blackwell datasheet, HGX B200 at 1,000 W (the per-GPU table in
    # glennklockwood.com/garden/processors/B200): 2,250 dense bf16, 1,100 tf32; fp32 75
    # (HGX B200 lists 600 for 8 GPUs; GB200's 1,200 W part is the 80 quoted elsewhere);
    # HBM3e at 8 TB/s; NVLink 5 1.8 TB/s both ways. DGX B200: 8x 400 Gb/s. 183,359 MiB
    # and 1,000 W: nvidia-smi printouts of "NVIDIA B200".
    "b200": GPU(
        "B200",
        _peaks(2250e12, 1100e12, 75e12),
        183_359 * MIB,
        8.0 * TB,
        900 * GB,
        50 * GB,
        1000.0,
        "NVIDIA HGX B200 specifications (1,000 W); DGX B200 datasheet",
    ),
    # AMD Instinct MI300X data sheet: 1,307.4 dense bf16, 653.7 tf32, 163.4 fp32 (matrix),
    # 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links of 64 GB/s each way to the other
    # seven GPUs; 448 GB/s assumes RCCL spreads one ring's channels over all 7 links (a
    # ring's neighbour is one link, 64 GB/s, unless it does), 750 W. Network: a
    # 400 Gb/s NIC a GPU, as the 8-GPU platforms ship. 205,822,885,888 B = 196,288 MiB:
    # rocm-smi's "VRAM Total Memory (B)".
    "mi300x": GPU(
        "MI300X",
        _peaks(1307.4e12, 653.7e12, 163.4e12),
        196_288 * MIB,
        5.3 * TB,
        448 * GB,
        50 * GB,
        750.0,
        "AMD Instinct MI300X data sheet",
    ),
    "cpu": GPU(
        "",  # Never matched by a device name: a CPU has no MFU.
        # An estimate, not a datasheet: 2 cores x 2.5 GHz x 32 fp32 FLOP a cycle (AVX2,
        # two FMA units of 8 lanes). bf16 has no faster path on it: the same peak.
        {"bf16": 160e9, "fp32": 160e9},
        24 * 2**30,  # The VM's 24 GiB (docs/results.md).
        20 * GB,  # Estimate: one DDR4 channel's share.
        5 * GB,  # Gloo over loopback shared memory: an estimate, not measured.
        1.25 * GB,  # Estimate: a 10 Gb/s NIC.
        None,
        "estimate for the 2-core VM: cores x clock x AVX2 FLOP per cycle",
    ),
    # MFU only (peaks from NVIDIA's datasheets: V100, T4, L4; whitepapers: GA102
    # appendix A for the RTX 3090, Ada for the RTX 4090).
    "v100-sxm2": GPU("V100 SXM2", {"fp16": 125e12, "fp32": 15.7e12}),
    "v100-pcie": GPU("V100 PCIe", {"fp16": 112e12, "fp32": 14e12}),
    "t4": GPU("T4", {"fp16": 65e12, "fp32": 8.1e12}),
    "a10g": GPU("A10G", _peaks(70e12, 35e12, 35e12)),
    "rtx-3090": GPU("RTX 3090", _peaks(71e12, 35.6e12, 35.6e12)),
    "l4": GPU("L4", _peaks(121e12, 60e12, 30.3e12)),
    "rtx-4090": GPU("RTX 4090", _peaks(165.2e12, 82.6e12, 82.6e12)),
}

# Words that mark another card (other peaks, memory or links) than the one a row names:
# "H100 NVL", "RTX 3090 Ti", "RTX 4090 D", a laptop part, "A100 80GB PCIe", "A100 40GB".
VARIANTS = {"nvl", "ti", "super", "d", "laptop", "mobile", "max", "pcie", "40gb"}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def match(device_name: str) -> str | None:
    """GPUS' key of a device name (torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB
    HBM3"), or None: the row whose name's words it holds, most specific first, unless it
    also holds a variant word the row does not name. Whole words: "L4" is not "L40S"."""
    words = set(_words(device_name))
    rows = [k for k in GPUS if GPUS[k].name]
    for key in sorted(rows, key=lambda k: len(_words(GPUS[k].name)), reverse=True):
        named = set(_words(GPUS[key].name))
        if named <= words:
            return None if (words - named) & VARIANTS else key
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one `device_name` GPU in `dtype` ("bf16", "fp16", "tf32",
    "fp32"), or None when the card or dtype is not in GPUS: a peak is never guessed."""
    key = match(device_name)
    return None if key is None else GPUS[key].flops.get(dtype)


def plannable() -> list[str]:
    """The keys 09 can plan for: the rows with memory and links."""
    return [k for k, g in GPUS.items() if g.memory is not None]


def get_gpu(name: str) -> GPU:
    """GPUS[name] (any case) that 09 can plan for, or ValueError naming them."""
    key = name.lower()
    if key not in plannable():
        raise ValueError(f"unknown GPU {name!r}: known are {', '.join(plannable())}")
    return GPUS[key]


def link_of(gpu: GPU, size: int, stride: int, gpus_per_node: int) -> float:
    """A group's slowest link (09's): NVLink if its `size` ranks, `stride` apart in the
    grid, share a node, else the network."""
    inside = size == 1 or size * stride <= gpus_per_node
    return gpu.nvlink if inside else gpu.network


def mfu(
    tokens_per_s, flops_per_token, n_devices, peak_flops_per_device
) -> float | None:
    """Achieved model FLOP/s (tokens_per_s: global) over all devices' peak; None if the
    peak is unknown."""
    if peak_flops_per_device is None:
        return None
    return tokens_per_s * flops_per_token / (n_devices * peak_flops_per_device)


# ------------------------------------------------------------ the roofline's constants
# Measured on this project's H200 (docs/results.md, "MFU: GPT-2 and up" and its profile;
# docs/gpu_h200.log): bench_compiled_step.py, bf16 autocast, torch.compile, cuDNN flash
# attention, fused AdamW, T = 1,024. Each constant is one of these measurements; 09's
# calibrate() fits the memory-bound bytes to the two step times below.
ROOFLINE = dict(
    # The matmuls ran at 721 TFLOP/s in GPT-2 124M (C = 768) and 742 in medium (C =
    # 1,024): e(C) = e_max C / (C + knee) through both (73% and 75% of the peak).
    matmul=((768, 721e12), (1024, 742e12)),
    # Attention (cuDNN's flash kernels) took 12% of 124M's 63.6 ms of kernels at B = 32:
    # 7.6 ms for 02's 12 L C T FLOPs a token (3.71e12), 49% of the peak.
    attention=3.71e12 / (0.12 * 63.6e-3),
    # AdamW and the clipping's foreach kernels: 4% of 63.6 ms (124M) and of 160.5 ms
    # (medium), for 124.4 M and 354.8 M parameters: 2.54 and 6.42 ms, at 4.8 TB/s
    # 98 and 87 bytes a parameter; their mean.
    param_bytes=(0.04 * 63.6e-3 / 124.4e6 + 0.04 * 160.5e-3 / 354.8e6) / 2 * 4.8e12,
    gpu="h200",
    source="docs/results.md: bench_compiled_step.py on one H200 and its torch.profiler",
)

# The measured runs each dtype's roofline is fitted to: (02's preset, micro-batch = B,
# tokens/s, shape overrides), on `gpu`. bf16: the two step times the memory-bound
# kernels (norms, GELU, residuals, casts, the loss's softmax) and the idle time are
# fitted to (docs/results.md, bench_compiled_step.py). One run (fp32:
# bench_mixed_precision.py, eager, B = 16; cpu: train.py's main job, 500 steps of
# 32 x 128 tokens on the 2-core VM): the whole step at one share of the peak.
SMALL_BPE = dict(vocab_size=4096, block_size=128)  # the main job's model
# compiled: whether the runs were (bf16's under torch.compile; fp32's, the CPU's eager).
CALIBRATION = {
    "bf16": dict(
        gpu="h200",
        runs=(("gpt2", 32, 515_639, {}), ("gpt2-medium", 32, 194_643, {})),
        compiled=True,
    ),
    "fp32": dict(gpu="h200", runs=(("gpt2", 16, 54_461, {}),), compiled=False),
    "cpu": dict(gpu="cpu", runs=(("small", 32, 8_500, SMALL_BPE),), compiled=False),
}

# train.py's loop over the lean step, a microbatch (docs/results.md, one H200, GPT-2
# 124M, bf16, compiled): at 64 x 1 it ran 485,697-492,176 tokens/s against the lean
# step's 519,019 (134.0 against 126.3 ms: +7.8 ms); at 32 x 2, 459,022-466,727 against
# 2 x 63.55 ms (141.6 against 127.1: +7.2 ms a microbatch). About the same a microbatch
# at both, not a token: the data loader, the token-normalised loss's count, the step's
# reads (evaluation and checkpoints apart: train.py leaves them out of tokens/s). The
# mean of the two, in seconds; measured on one GPU and one model, assumed on every GPU.
_LEAN = {32: 32_768 / 515_639, 64: 65_536 / 519_019}  # a lean microbatch's seconds
_OVER_64 = 65_536 / ((485_697 + 492_176) / 2) - _LEAN[64]
_OVER_32 = (65_536 / ((459_022 + 466_727) / 2) - 2 * _LEAN[32]) / 2
TRAINER_OVERHEAD = (_OVER_64 + _OVER_32) / 2

# Selective recomputation's time: its step over none's, measured (docs/results.md,
# "Recomputation": bf16 autocast, B = 16, eager, one H200: 67.6 / 49.8 ms). Not measured
# under torch.compile, where the calibrating runs ran: there it is an upper bound.
SELECTIVE_SLOWDOWN = 67.6 / 49.8

# Eager mode's time: a zero-bubble step (05c, `--schedule zb1`) runs uncompiled, since
# train.py refuses `--compile` with it. Measured on one H200, GPT-2 124M, bf16 autocast
# (docs/results.md): compiled 515,639 tok/s at B = 32, eager 328,679 at B = 16 (the
# precision table). The batches differ; compiled B = 64 runs within 1% of B = 32, so
# the batch explains little of the 1.57x.
EAGER_SLOWDOWN = 515_639 / 328_679


def calibration_row(dtype: str, gpu: str) -> str:
    """CALIBRATION's key that a plan in `dtype` on `gpu` is fitted on."""
    return "cpu" if gpu.lower() == "cpu" else dtype


def eager_slowdown(dtype: str, gpu: str, compiled: bool) -> float:
    """The factor on a step's kernels run without torch.compile (train.py's default,
    and zb1 always): EAGER_SLOWDOWN where the fitted runs were compiled, else 1."""
    fitted_compiled = CALIBRATION[calibration_row(dtype, gpu)]["compiled"]
    return EAGER_SLOWDOWN if fitted_compiled and not compiled else 1.0


def width_efficiency(points=ROOFLINE["matmul"]) -> tuple[float, float]:
    """(e_max, knee) of e(C) = e_max C / (C + knee) through the two measured (C, FLOP/s)
    of the matmuls, as shares of the H200's peak."""
    (c1, f1), (c2, f2) = points
    peak = GPUS[ROOFLINE["gpu"]].flops["bf16"]
    e1, e2 = f1 / peak, f2 / peak
    knee = (
        c1 * c2 * (e2 - e1) / (c2 * e1 - c1 * e2)
    )  # e1 (c1 + k) / c1 = e2 (c2 + k) / c2
    return e1 * (c1 + knee) / c1, knee


def roofline_seconds(spec: GPU, fit: dict, dtype: str, *counts) -> tuple:
    """(seconds, attention's seconds) of a GPU's kernels, each part at its own limit:
    matmuls at e(C) = e_max C / (C + knee) of the peak, attention at its share, the
    memory-bound bytes over HBM. counts: 09's roofline_counts (matmul FLOPs, attention
    FLOPs, width C, L C and V tokens, parameters stepped); fit: 09's calibrate()."""
    matmuls, attention, C, layer, vocab, stepped = counts
    peak = spec.flops[dtype]
    e = fit["e_max"] * C / (C + fit["knee"])
    attention_s = attention / (peak * fit["attention"])
    moved = fit["layer_bytes"] * layer + fit["vocab_bytes"] * vocab
    moved += fit["param_bytes"] * stepped
    return matmuls / (peak * e) + attention_s + moved / spec.hbm, attention_s


def fit_roofline(gpu: str, dtype: str, runs) -> dict:
    """The roofline on `gpu` in `dtype`, from measured runs: (seconds, 09's
    roofline_counts) each. One run: the whole step at one share e of the peak (e(C) = e,
    nothing memory-bound). Two (bf16): ROOFLINE's e(C), attention's share and bytes a
    parameter from the profile, then the memory-bound bytes a token, layer_bytes L C +
    vocab_bytes V, through the two times: what their matmuls, attention and optimizer
    leave, at the GPU's HBM bandwidth (its idle time too)."""
    spec = GPUS[gpu]
    peak = spec.flops[dtype]
    fit = dict(layer_bytes=0.0, vocab_bytes=0.0, param_bytes=0.0, knee=0.0)
    if len(runs) == 1:
        seconds, (matmuls, attention, *_) = runs[0]
        e = (matmuls + attention) / seconds / peak
        return dict(fit, e_max=e, attention=e)
    fit["e_max"], fit["knee"] = width_efficiency()
    fit["attention"] = ROOFLINE["attention"] / peak
    fit["param_bytes"] = ROOFLINE["param_bytes"]
    left = []  # (L C tokens, V tokens, memory-bound bytes left)
    for seconds, counts in runs:
        known, _ = roofline_seconds(spec, fit, dtype, *counts)
        left.append((counts[3], counts[4], (seconds - known) * spec.hbm))
    (x1, v1, y1), (x2, v2, y2) = left
    # y = layer_bytes x + vocab_bytes v, twice: Cramer's rule.
    det = x1 * v2 - x2 * v1
    fit["layer_bytes"] = (y1 * v2 - y2 * v1) / det
    fit["vocab_bytes"] = (x1 * y2 - x2 * y1) / det
    return fit


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
    for key, gpu in GPUS.items():
        peaks = "  ".join(f"{k} {v / 1e12:7.1f}" for k, v in gpu.flops.items())
        print(f"{key:<10} {peaks} TFLOP/s  {gpu.source}")
    if len(sys.argv) > 1:  # a device name, as torch.cuda.get_device_name() gives it
        key = match(sys.argv[1])
        print(
            sys.argv[1],
            "->",
            key,
            {d: peak_flops(sys.argv[1], d) for d in _peaks(0, 0, 0)},
        )
