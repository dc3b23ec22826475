"""The figures of compiled programs as lines of text (and as a dict for --json)."""

from __future__ import annotations

from typing import Any

from largebatch_jax.aot.hlo import Audit
from largebatch_jax.aot.programs import Compiled
from largebatch_jax.aot.targets import Accelerator


def size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:.0f} B"


def describe(name: str, c: Compiled, chip: Accelerator, unit: str, images: int) -> list[str]:
    """Memory, cost, collectives and the roofline bound of one program, per device."""
    roof = c.roofline_s(chip)
    bound = (
        "compute"
        if c.flops / chip.peak_bf16_flops >= c.bytes_accessed / chip.memory_bandwidth
        else "memory"
    )
    lines = [f"{name}: compiled in {c.compile_s:.1f} s"]
    if c.chain:
        lines.append(
            f"  programs per step: {', '.join(c.chain)}; memory at its peak ({c.peak}), "
            "the arguments being all the step holds then"
        )
    lines += [
        f"  memory per {unit}: arguments {size(c.argument_bytes)}, outputs "
        f"{size(c.output_bytes)} (aliased {size(c.alias_bytes)}), temporaries "
        f"{size(c.temp_bytes)}, code {size(c.code_bytes)}; total {size(c.memory_bytes)} of "
        f"{size(chip.memory_bytes)} ({c.memory_bytes / chip.memory_bytes:.0%})",
        f"  FLOPs per step {c.flops / 1e9:,.3f} G ({c.flops / images / 1e9:.3f} G per image), "
        f"bytes accessed {c.bytes_accessed / 1e9:,.3f} GB "
        f"({c.bytes_accessed / images / 1e6:.2f} MB per image)",
    ]
    kinds: dict[str, list[int]] = {}
    for col in c.collectives:
        kinds.setdefault(col.kind, []).append(col.bytes)
    for kind, sizes in kinds.items():
        lines.append(
            f"  {kind}: {len(sizes)} op(s), {size(sum(sizes))} ("
            + ", ".join(size(s) for s in sorted(sizes, reverse=True)[:4])
            + (", ..." if len(sizes) > 4 else "")
            + ")"
        )
    if not kinds:
        lines.append("  no collectives")
    lines.append(
        f"  roofline: >= {1e3 * roof:.2f} ms per step ({bound}-bound), <= "
        f"{images / roof:,.0f} images/s per {unit}"
        if roof > 0
        else "  roofline: unknown (this jax gives no cost analysis)"
    )
    return lines + describe_audit(c.audit)


def describe_audit(a: Audit) -> list[str]:
    """The cuDNN calls, scatters and sorts, and layout changes of a compiled program."""
    lines = []
    if a.convolutions:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(a.convolutions.items()))
        lines.append(
            f"  cuDNN convolutions: {sum(a.convolutions.values())} ({kinds}); their operands "
            f"and results {size(a.convolution_bytes)}"
        )
    if a.scatters:
        lines.append(
            "  scatter / select-and-scatter / sort: "
            + "; ".join(f"{op} of {n:,} elements from {src}" for op, n, src in a.scatters)
        )
    else:
        lines.append("  no scatter, select-and-scatter or sort")
    if a.convolutions:
        moved = "; ".join(
            f"{where}: {count} op(s) writing {size(b)}"
            for where, (count, b) in sorted(a.relayouts.items())
        )
        lines.append(f"  layout changes around the convolutions: {moved or 'none'}")
    return lines


def as_dict(c: Compiled, chip: Accelerator, images: int) -> dict[str, Any]:
    """The figures of one program, for --json."""
    return {
        "memory_bytes": c.memory_bytes,
        "argument_bytes": c.argument_bytes,
        "output_bytes": c.output_bytes,
        "alias_bytes": c.alias_bytes,
        "temp_bytes": c.temp_bytes,
        "flops": c.flops,
        "bytes_accessed": c.bytes_accessed,
        "collectives": [[col.kind, col.bytes] for col in c.collectives],
        "roofline_s": c.roofline_s(chip),
        "roofline_images_per_s": images / c.roofline_s(chip) if c.roofline_s(chip) else None,
        "convolutions": c.audit.convolutions,
        "scatters": [list(s) for s in c.audit.scatters],
        "programs": list(c.chain),
        "memory_peak_at": c.peak,
    }
