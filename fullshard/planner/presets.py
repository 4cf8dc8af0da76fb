"""`--hardware`: a preset from vendors' data sheets, a JSON file of `Hardware` fields
(`timing.py`; `{"base": "h100-sxm", ...}` changes a preset), or `local`: this machine,
measured now (hardware.py; some 10-30 s on a loaded 2-core machine).

Presets (data sheets: NVIDIA H100 SXM5, H200 SXM, A100 80GB SXM4, L40S; NVLink 4 = 900 GB/s
both directions per GPU, NVLink 3 = 600 GB/s; ConnectX-7 NDR = 400 Gb/s per GPU, HDR = 200
Gb/s). Latencies are NCCL's per-ring-step order of magnitude, not data-sheet numbers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fullshard.planner.hardware import measure_local
from fullshard.planner.timing import Hardware

_G = 1e9
_T = 1e12


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
    """A `Hardware`, a preset name, 'local' (measured now) or a JSON file."""
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
