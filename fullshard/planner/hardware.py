"""What the time model needs to know about the machines: a `Hardware` description, presets from
vendors' data sheets, and `--hardware FILE` (JSON with the same fields).

Fields (SI units: FLOP/s, bytes/s, seconds, bytes):

    peak_flops        dense matmul peak in the training dtype (bf16/fp16 tensor cores on GPUs;
                      `peak_flops_fp32` for fp32 models)
    matmul_efficiency the fraction of that peak large matmuls reach (stated, not fitted)
    mem_bandwidth     device memory bandwidth; every non-matmul op is priced as memory-bound
    mem_efficiency    the fraction of it elementwise kernels reach
    op_overhead       fixed seconds per kernel (launch / dispatch; on GPUs mostly hidden by
                      asynchronous launches, on CPUs the eager dispatcher's cost)
    attention_score_s seconds per attention score (profile.py) of a fused attention kernel,
                      forward and backward together, beyond its FLOPs at the matmul rate: the
                      softmax's exp, max and scaling per score and the kernel's blocking
                      (measured by `--hardware local`; 0 in the presets, where the FLOPs
                      dominate)
    transcendental_s  seconds per element of a transcendental elementwise op (GELU, softmax,
                      ...; profile.py), forward and backward together, beyond its bytes at
                      mem_bandwidth (measured by `--hardware local`; 0 in the presets)
    unit_overhead     fixed seconds per unit per pass for the engine's hooks and bookkeeping
    param_overhead    fixed seconds per parameter of a unit per pass (the engine's work per
                      parameter: views installed and removed, gradients handed out; 0 in
                      the presets, measured by `--hardware local`)
    regather_overhead, regather_param_overhead  the same for ZeRO-3's second gather of a unit
                      in backward (per unit, per parameter): the engine's work beyond
                      ZeRO-2's (measured by `--hardware local`, 0 in the presets)
    memory            device memory (the default budget)
    intra_bw, intra_latency  per-GPU bandwidth (one direction) and per-step latency of the
                      links inside a node (NVLink, PCIe, or loopback; on gloo the latency is
                      one pairwise exchange's fixed cost, see `timing.py`)
    inter_bw, inter_latency  the same between nodes (InfiniBand / RoCE / Ethernet, per GPU)
    ranks_per_node    GPUs per node (HYBRID's default shard size; rings wider than this cross
                      the network)
    backend           the collective backend these links are driven by ('nccl', 'gloo')
    host_bw           host <-> device copies (CPU offload: PCIe), host_mem_bandwidth the host
                      memory the offloaded optimizer step streams through
    optimizer_tensor_s, optimizer_byte_s  a measured optimizer step (`--hardware local` times
                      torch's AdamW): seconds per parameter tensor and per byte of shard; 0
                      (the presets): priced from mem_bandwidth and op_overhead instead
    overlap           fraction of communication that can run while compute runs (1.0 on GPUs,
                      where collectives have their own streams and copy engines; lower on CPUs,
                      where gloo's threads share the cores with compute)
    drift_per_s, drift_max  how far ranks that share cores drift apart while they compute:
                      an exchange starts `min(drift_max, drift_per_s * c)` after it was
                      issued, `c` the compute since the ranks last waited together (the first
                      to arrive waits for the last; timing.py). Measured by
                      `--hardware local`; 0 in the presets (a rank per GPU does not drift)

Presets (data sheets: NVIDIA H100 SXM5, H200 SXM, A100 80GB SXM4, L40S; NVLink 4 = 900 GB/s
both directions per GPU, NVLink 3 = 600 GB/s; ConnectX-7 NDR = 400 Gb/s per GPU, HDR = 200
Gb/s). Latencies are NCCL's per-ring-step order of magnitude, not data-sheet numbers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

_G = 1e9
_T = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float
    peak_flops_fp32: float
    matmul_efficiency: float
    mem_bandwidth: float
    memory: int
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    ranks_per_node: int = 8
    mem_efficiency: float = 0.7
    op_overhead: float = 0.0
    attention_score_s: float = 0.0
    transcendental_s: float = 0.0
    unit_overhead: float = 0.0
    param_overhead: float = 0.0
    regather_overhead: float = 0.0
    regather_param_overhead: float = 0.0
    overlap: float = 1.0
    drift_per_s: float = 0.0
    drift_max: float = 0.0
    backend: str = "nccl"
    host_bw: float = 25e9
    host_mem_bandwidth: float = 100e9
    optimizer_tensor_s: float = 0.0
    optimizer_byte_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float | int) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"Hardware field {f.name} must be >= 0, got {v!r}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")

    def flops_rate(self, dtype: torch.dtype) -> float:
        """Achievable matmul FLOP/s for a compute dtype."""
        peak = self.peak_flops_fp32 if dtype == torch.float32 else self.peak_flops
        return peak * self.matmul_efficiency

    def link(self, ranks: int, spans_nodes: bool, *, one_per_node: bool = False
             ) -> tuple[float, float]:
        """(bandwidth per rank, latency per step) of a ring over `ranks`.

        Inside a node: NVLink. A ring over whole nodes (FULL_SHARD over 64 ranks) runs as
        `ranks_per_node` rings at once, one per NIC (NCCL's multi-ring layout): each chunk
        enters a node once, through one of its NICs, and travels inside over NVLink, so a
        rank's effective bandwidth is `ranks_per_node * inter_bw`, capped by NVLink. A ring
        of one rank per node (HYBRID's replicate axis) has only its own NIC: `inter_bw`.
        """
        if not spans_nodes:
            return self.intra_bw, self.intra_latency
        if one_per_node:
            return self.inter_bw, self.inter_latency
        return min(self.intra_bw, self.ranks_per_node * self.inter_bw), self.inter_latency

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100-sxm", peak_flops=989 * _T, peak_flops_fp32=67 * _T,
                 matmul_efficiency=0.6, mem_bandwidth=3350 * _G, memory=80 * 2**30,
                 intra_bw=450 * _G, intra_latency=5e-6, inter_bw=50 * _G, inter_latency=10e-6,
                 op_overhead=2e-6, unit_overhead=30e-6,
                 source="NVIDIA H100 SXM5 data sheet; NVLink 4; ConnectX-7 NDR 400 Gb/s/GPU"),
        Hardware("h200-sxm", peak_flops=989 * _T, peak_flops_fp32=67 * _T,
                 matmul_efficiency=0.6, mem_bandwidth=4800 * _G, memory=141 * 10**9,
                 intra_bw=450 * _G, intra_latency=5e-6, inter_bw=50 * _G, inter_latency=10e-6,
                 op_overhead=2e-6, unit_overhead=30e-6,
                 source="NVIDIA H200 SXM data sheet; NVLink 4; ConnectX-7 NDR 400 Gb/s/GPU"),
        Hardware("a100-80gb", peak_flops=312 * _T, peak_flops_fp32=19.5 * _T,
                 matmul_efficiency=0.7, mem_bandwidth=2039 * _G, memory=80 * 2**30,
                 intra_bw=300 * _G, intra_latency=6e-6, inter_bw=25 * _G, inter_latency=10e-6,
                 op_overhead=3e-6, unit_overhead=30e-6,
                 source="NVIDIA A100 80GB SXM4 data sheet; NVLink 3; HDR 200 Gb/s per GPU"),
        Hardware("l40s", peak_flops=362 * _T, peak_flops_fp32=91.6 * _T,
                 matmul_efficiency=0.6, mem_bandwidth=864 * _G, memory=48 * 2**30,
                 intra_bw=25 * _G, intra_latency=10e-6, inter_bw=12.5 * _G,
                 inter_latency=20e-6, op_overhead=3e-6, unit_overhead=30e-6,
                 source="NVIDIA L40S data sheet (dense bf16); PCIe Gen4 x16; 100 GbE per GPU"),
    )
}


def resolve_hardware(hardware: object) -> Hardware:
    """A `Hardware`, a preset name, 'local' (measured now, see `measure.py`) or a JSON file."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, dict):
        return _from_dict(hardware, "the hardware dict")
    if not isinstance(hardware, str | Path):
        raise TypeError(f"hardware must be a preset name ({', '.join(PRESETS)}), 'local', a "
                        f"JSON file path or a Hardware; got {type(hardware).__name__}")
    key = str(hardware).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key == "local":
        from fullshard.planner.measure import measure_local

        return measure_local()
    path = Path(str(hardware))
    if not path.is_file():
        raise ValueError(f"Unknown hardware {hardware!r}: not a preset ({', '.join(PRESETS)}), "
                         f"not 'local', and no such file.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"Hardware file {path} is not valid JSON: {e}") from None
    return _from_dict(data, f"hardware file {path}")


def _from_dict(data: object, where: str) -> Hardware:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object of Hardware fields")
    base = data.get("base")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = set(data) - fields - {"base"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; valid: {sorted(fields)}")
    values = {k: v for k, v in data.items() if k != "base"}
    if base is not None:  # {"base": "h100-sxm", "inter_bw": 25e9}: a preset with changes
        if base not in PRESETS:
            raise ValueError(f"{where}: base {base!r} is not a preset ({', '.join(PRESETS)})")
        return dataclasses.replace(PRESETS[base], **values)
    missing = {f.name for f in dataclasses.fields(Hardware)
               if f.default is dataclasses.MISSING} - set(values)
    if missing:
        raise ValueError(f"{where}: missing field(s) {sorted(missing)} (or give a 'base' "
                         f"preset: {', '.join(PRESETS)})")
    return Hardware(**values)
