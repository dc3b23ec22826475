"""python -m largebatch_jax.aot: compile the real train and eval steps for a TPU slice or an
NVIDIA GPU cluster on this host, which has neither (see the package's docstring)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from largebatch_jax import errors, host

# This host compiles, it runs nothing: JAX starts only its CPU backend. Before jax and
# libtpu load.
os.environ["JAX_PLATFORMS"] = "cpu"
host.tpu_compiler_only()

with host.plugin_noise_filtered():
    import jax
    from absl import app, flags
    from ml_collections import config_flags

    from largebatch_jax import exact, parallel
    from largebatch_jax.aot import programs, report, targets
    from largebatch_jax.workdir import output_file_problem

    jax.devices()  # the backend starts here, and JAX loads its plugins

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.")
_TOPOLOGY = flags.DEFINE_string(
    "topology",
    None,
    "A TPU slice (v5e-256, v4-512, v5p-128, or a torus such as v5e:4x8) or an NVIDIA GPU "
    "cluster as hosts x GPUs per host (h100:32x8, a100:1x8; a100, a100-40, h100, h200, b200).",
)
_PER_DEVICE = flags.DEFINE_string(
    "per_device_batch",
    None,
    "Images per chip or GPU per micro-step (accum_steps then follows from kn), or 'max': "
    "the largest that fits. Default: the config's batch_size / devices / accum_steps.",
)
flags.DEFINE_alias("per_chip_batch", "per_device_batch")
flags.DEFINE_alias("per_gpu_batch", "per_device_batch")
_REFERENCE = flags.DEFINE_bool(
    "reference", False, "Also compile the Flax-example-style reference step."
)
_JSON = flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
_PTXAS = flags.DEFINE_string(
    "ptxas",
    None,
    "GPU targets: the PTX assembler to compile with. Default: the one of the gpu-compiler "
    "extra's pip package; a GPU host without it may name its own CUDA toolkit's.",
)


def _sized(config: Any, where: Any, unit: str, per_device_batch: str | None) -> Any:
    """The config with the micro-batch asked for: 'max' (the largest that fits), a number,
    or the config's own."""
    devices = where.engine.num_devices
    if per_device_batch == "max":
        print(f"largest micro-batch per {unit} on {where.target.name}:", flush=True)
        return programs.with_micro_batch(
            config, devices, programs.largest_micro_batch(config, where)
        )
    if per_device_batch:
        return programs.with_micro_batch(config, devices, int(per_device_batch))
    return config


def _header(config: Any, plan: Any, target: Any, unit: str, assembler: str) -> str:
    options = exact.compiler_options(target.platform) if plan.reduction == "exact" else {}
    return (
        f"{config.model} kn={plan.kn} n={plan.n} {plan.dtype} "
        f"{config.image_size}x{config.image_size} reduction={plan.reduction} on "
        f"{target.chip.name} {target.name} ({plan.devices} {unit}s): {plan.micro_batch} images "
        f"per {unit} x {plan.accum_steps} accum_steps (resolved for {target.platform}: "
        f"accum_loop {plan.accum_loop}, max-pool "
        f"gradient {'slices' if parallel.is_gpu(target.platform) else 'xla'}"
        + (f", XLA options {options}" if options else "")
        + f") | jax {jax.__version__}"
        + (f" | {assembler}" if assembler else "")
    )


def _gradient_line(plan: Any, ours: dict) -> str:
    expected = programs.gradient_and_statistics_bytes(ours["state"])
    # The gradients travel in the all-reduces (fast), or the all-to-all (exact: the
    # reduce-scatter half of its deterministic sum).
    kind = "all-to-all" if plan.reduction == "exact" else "all-reduce"
    carried = sum(c.bytes for c in ours["train"].collectives if c.kind == kind)
    return (
        f"gradients + BN statistics + 2 scalars: {report.size(expected)}; the train step's "
        f"{kind}s carry {report.size(carried)}"
        + (
            " (XLA sends identical gradients once: a block's last BN bias and its "
            "projection shortcut's BN bias get the same gradient)"
            if carried < expected and kind == "all-reduce"
            else ""
        )
    )


def _reference(config: Any, plan: Any, where: Any, mine: Any, unit: str) -> tuple[list, Any]:
    """The Flax-example-style step compiled for the same target, and ours against it."""
    chip, micro = where.target.chip, plan.micro_batch
    ref = programs.compile_reference(config, where, micro)
    lines = report.describe("train step (reference, Flax example style)", ref, chip, unit, micro)
    # Per image: the reference has no accumulation, one step is one micro-batch.
    steps = plan.accum_steps
    for label, a, b in (
        ("bytes accessed", mine.bytes_accessed / steps, ref.bytes_accessed),
        ("temporaries", mine.temp_bytes, ref.temp_bytes),
        ("roofline time", mine.roofline_s(chip) / steps, ref.roofline_s(chip)),
    ):
        lines.append(f"ours / reference, {label} per micro-batch: {a / b:.2f}x")
    return lines, report.as_dict(ref, chip, micro)


def run(
    config: Any,
    topology: str,
    per_device_batch: str | None,
    reference: bool,
    json_path: str | None,
    ptxas: str | None = None,
) -> int:
    target = targets.parse_topology(topology)
    if target.platform == "tpu":
        # libtpu reads these when it loads (for the first slice description); unset, it
        # prints start-up errors about them. They change nothing in the compile.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.accelerator_type)
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    options, assembler = ({}, "")
    if target.platform == "cuda":
        options, assembler = targets.gpu_compile_options(Path(ptxas) if ptxas else None)
    where = programs.site(target, options)
    devices = where.engine.num_devices
    unit = "GPU" if target.platform == "cuda" else "chip"
    config = _sized(config, where, unit, per_device_batch)
    plan = programs.plan_for(config, where)  # main.py's checks, for the target
    print(_header(config, plan, target, unit, assembler), flush=True)
    print(f"FLOPs and bytes: {programs.COST_SOURCES[target.platform]}.", flush=True)
    ours = programs.compile_ours(config, plan, where)
    images = plan.micro_batch * plan.accum_steps
    lines = report.describe("train step (ours)", ours["train"], target.chip, unit, images)
    if ours["extrapolated"]:
        lines.append(
            f"  (FLOPs and bytes: {plan.accum_steps} micro-steps, extrapolated from the 1- and "
            "2-micro-step unrolled programs; XLA counts a loop body once)"
        )
    eval_images = plan.eval_batch_per_device
    lines += report.describe("eval step (ours)", ours["eval"], target.chip, unit, eval_images)
    lines.append(_gradient_line(plan, ours))
    figures: dict[str, Any] = {
        "target": target.name,
        "devices": devices,
        "per_device_batch": plan.micro_batch,
        "accum_steps": plan.accum_steps,
        "dtype": plan.dtype,
        "reduction": plan.reduction,
        "train": report.as_dict(ours["train"], target.chip, images),
        "eval": report.as_dict(ours["eval"], target.chip, eval_images),
        "gradients_and_statistics_bytes": programs.gradient_and_statistics_bytes(ours["state"]),
    }
    if reference:
        ref_lines, figures["reference"] = _reference(config, plan, where, ours["train"], unit)
        lines += ref_lines
    print("\n".join(lines), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    flags.mark_flags_as_required(["config", "topology"])

    def _main(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments: {args[1:]}")
        # Executables for described (not attached) devices cannot go through the
        # persistent compilation cache: every lookup fails with a warning.
        jax.config.update("jax_enable_compilation_cache", False)
        problem = _JSON.value and output_file_problem("--json", _JSON.value)
        if problem:  # before the compile, not after it
            errors.print_error(problem)
            return 2
        try:
            return run(
                _CONFIG.value,
                _TOPOLOGY.value,
                _PER_DEVICE.value,
                _REFERENCE.value,
                _JSON.value,
                _PTXAS.value,
            )
        except ValueError as e:
            errors.print_error(e)
            return 2

    app.run(lambda args: sys.exit(_main(args)), argv)


if __name__ == "__main__":
    main()
