"""The machines 09_plan.py plans for: peak FLOP/s, memory, bandwidths, power, sources.

Every number is a vendor datasheet's (no network here: cited from the datasheets as
published, not fetched), except the "cpu" row, this project's 2-core VM, which is an
estimate said as one, and memory, which is the capacity the card reports (nvidia-smi's
MiB; torch.cuda.get_device_properties' total_memory), not the datasheet's round "80 GB":
H100 80GB HBM3 81,559 MiB (nvidia-smi in github.com/NVIDIA/nccl issue 1264, and the
table in github.com/modal-labs/modal-client pull 2797), A100-SXM4-80GB 81,920 MiB (the
same table), H200 143,771 MiB (this project's H200: docs/results.md). Bandwidths are
per GPU and per direction, in bytes/s: NVLink's "900 GB/s" on a datasheet is both
directions together, 450 GB/s each way. Peaks are dense (no 2:4 sparsity), as
support/gpus.PEAK_FLOPS, whose rows these share.
"""

from dataclasses import dataclass

from support.gpus import PEAK_FLOPS

GB = 1e9
TB = 1e12
MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator of a node, and the links out of it."""

    name: str
    flops: dict  # Dense peak FLOP/s by dtype: "bf16", "fp32".
    memory: float  # Bytes of device memory, as the card reports it.
    hbm: float  # Device memory bandwidth, bytes/s.
    nvlink: float  # Bytes/s one way to a GPU of the same node.
    network: float  # Bytes/s one way to another node (this GPU's share of the NICs).
    watts: float | None  # Board power (TDP) at full load; None: unknown.
    source: str


GPUS = {
    "h100": GPU(
        name="NVIDIA H100 SXM5 80GB",
        flops={"bf16": PEAK_FLOPS["H100"]["bf16"], "fp32": PEAK_FLOPS["H100"]["fp32"]},
        memory=81_559 * MIB,
        hbm=3.35 * TB,
        nvlink=450 * GB,
        network=50 * GB,
        watts=700.0,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, "
        "NVLink 900 GB/s, up to 700 W); DGX H100 datasheet: 8x 400 Gb/s NDR per node",
    ),
    "h200": GPU(
        name="NVIDIA H200 SXM 141GB",
        flops={"bf16": PEAK_FLOPS["H200"]["bf16"], "fp32": PEAK_FLOPS["H200"]["fp32"]},
        memory=143_771 * MIB,
        hbm=4.8 * TB,
        nvlink=450 * GB,
        network=50 * GB,
        watts=700.0,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, "
        "NVLink 900 GB/s, up to 700 W); DGX H200 datasheet: 8x 400 Gb/s NDR per node",
    ),
    "a100": GPU(
        name="NVIDIA A100 SXM4 80GB",
        flops={"bf16": PEAK_FLOPS["A100"]["bf16"], "fp32": PEAK_FLOPS["A100"]["fp32"]},
        memory=81_920 * MIB,
        hbm=2.039 * TB,
        nvlink=300 * GB,
        network=25 * GB,
        watts=400.0,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: HBM2e 2,039 GB/s, "
        "NVLink 600 GB/s, 400 W); DGX A100 datasheet: 8x 200 Gb/s HDR per node",
    ),
    "cpu": GPU(
        name="2-core x86 VM (this project's CPU runs)",
        # An estimate, not a datasheet: 2 cores x 2.5 GHz x 32 fp32 FLOP a cycle (AVX2,
        # two FMA units of 8 lanes). bf16 has no faster path on it: the same peak.
        flops={"bf16": 160e9, "fp32": 160e9},
        memory=24 * 2**30,  # The VM's 24 GiB (docs/results.md).
        hbm=20 * GB,  # Estimate: one DDR4 channel's share.
        nvlink=5 * GB,  # Gloo over loopback shared memory: an estimate, not measured.
        network=1.25 * GB,  # Estimate: a 10 Gb/s NIC.
        watts=None,
        source="estimate for the 2-core VM: cores x clock x AVX2 FLOP per cycle",
    ),
}


# The matmul efficiency e and a layer's fixed time per microbatch c (launches and small
# kernels that do not grow with it): a step of m microbatches of b sequences of T takes
# m (b T FLOPs/token / (peak e) + L c). runs: (micro-batch, measured tokens/s), one
# microbatch a step; two runs fit both e and c, one run fits e (c = 0). Every other run
# in docs/results.md is a prediction from these (09_plan.py).
CALIBRATION = {
    "bf16": dict(
        gpu="h200",
        model="gpt2",
        runs=((32, 515_639), (64, 519_019)),
        seq_len=1024,
        run="docs/results.md: bench_compiled_step.py, GPT-2 124M, B = 32 and 64, compiled",
    ),
    "fp32": dict(
        gpu="h200",
        model="gpt2",
        runs=((16, 54_461),),
        seq_len=1024,
        run="docs/results.md: bench_mixed_precision.py, GPT-2 124M, fp32, B = 16",
    ),
    "cpu": dict(
        gpu="cpu",
        model="small",
        runs=((32, 8_500),),
        seq_len=128,
        vocab_size=4096,
        run="docs/training.md: the main job, 500 steps of 4,096 tokens, 2-core VM",
    ),
}

# Selective recomputation's time: its step over none's, measured (docs/results.md,
# "Recomputation": bf16 autocast, B = 16, eager, one H200: 67.6 / 49.8 ms). Not measured
# under torch.compile, where the calibrating runs ran: there it is an upper bound.
SELECTIVE_SLOWDOWN = 67.6 / 49.8


def get_gpu(name: str) -> GPU:
    """GPUS[name] (any case), or ValueError naming the known ones."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: known are {', '.join(GPUS)}")
    return GPUS[key]
