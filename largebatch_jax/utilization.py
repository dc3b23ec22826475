"""How much of the hardware a step uses: its FLOPs per device (XLA's cost analysis of the
compiled program, read as `largebatch_jax.aot` reads it), the device's published peak
(`aot.targets`) and its memory in use. On CPU devices there is no peak to compare with:
`Hardware.of` gives none, and the log shows neither TFLOP/s nor MFU there."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from largebatch_jax import private
from largebatch_jax.aot.targets import Accelerator, accelerator_of


def hlo_cost(module: Any) -> dict[str, float]:
    """XLA's HLO cost analysis of an HloModule, run by the CPU client (it analyses any
    backend's HLO; the GPU compiler itself returns none): a private API
    (`private.hlo_cost_analysis`; another jax: {}, no FLOPs or bytes, the rest stays)."""
    return private.hlo_cost_analysis(module)


def program_flops(lowered: Any, compiled: Any, platform: str) -> float:
    """FLOPs per device of one run of a program: the TPU compiler's cost analysis of the
    compiled program; elsewhere the HLO cost analysis of the program as lowered (the GPU
    compiler reports none)."""
    if platform == "tpu":
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        return float((cost or {}).get("flops", 0.0))
    return float(hlo_cost(lowered.compiler_ir("hlo").as_hlo_module()).get("flops", 0.0))


def step_flops(lowered: Any, compiled: Any, platform: str) -> float:
    """FLOPs per device of one train step, lowered and compiled (`parallel.LoweredChain`
    and its `CompiledChain`): every program times its runs per step."""
    return sum(
        p.runs * program_flops(p.program, c.program, platform)
        for p, c in zip(lowered.programs, compiled.programs, strict=True)
    )


def counts_every_micro_step(reduction: str, accum_steps: int, accum_loop: str) -> bool:
    """Whether the cost analysis of the step counts all of its micro-steps: XLA counts a
    loop body once, so a step that scans over `accum_steps` > 1 micro-steps (the fast
    reduction with `accum_loop` 'scan') is under-counted."""
    return reduction == "exact" or accum_steps == 1 or accum_loop != "scan"


def memory_in_use(devices: Sequence[Any]) -> tuple[int, int] | None:
    """(the largest peak bytes in use, that device's limit) over `devices`, from the
    runtime's allocator; None where it keeps no such figures (CPU devices)."""
    best = None
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "peak_bytes_in_use" not in stats or not stats.get("bytes_limit"):
            continue
        if best is None or stats["peak_bytes_in_use"] > best[0]:
            best = (int(stats["peak_bytes_in_use"]), int(stats["bytes_limit"]))
    return best


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a log point compares a step with: the FLOPs per device of one step (None
    where not counted) and the device's published figures (None on CPU)."""

    chip: Accelerator | None
    flops_per_step: float | None
    local_devices: tuple[Any, ...]

    @classmethod
    def of(
        cls,
        devices: Sequence[Any],
        flops: Any,
    ) -> Hardware:
        """`flops`: a callable giving the FLOPs per device of one step, called only where
        the device has a published peak (its analysis is not free on a large program)."""
        first = devices[0]
        chip = accelerator_of(first.platform, first.device_kind)
        return cls(chip, flops() if chip is not None else None, tuple(devices))

    def tflops_and_mfu(self, steps: int, seconds: float) -> tuple[float, float] | None:
        """(achieved TFLOP/s per device, model FLOPs utilisation against the dense bf16
        peak) over `steps` steps in `seconds`; None where either is unknown."""
        if self.chip is None or not self.flops_per_step or seconds <= 0:
            return None
        achieved = self.flops_per_step * steps / seconds
        return achieved / 1e12, achieved / self.chip.peak_bf16_flops

    def memory(self) -> tuple[int, int] | None:
        return memory_in_use(self.local_devices)
