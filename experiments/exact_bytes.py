"""Where the exact step's bytes go: the fast and the exact train step compiled for a TPU
target, their optimised HLO read op by op.

    python -m experiments.exact_bytes --config=configs/imagenet_8k.py --topology=v5e-8 \\
        --per_chip_batch=32 [--dump=DIR]

The config runs at kn = chips x `--per_chip_batch` in one micro-step: the per-chip
program of the paper's slice (v5e-256, 32 images per chip) on a small one. For each
program: XLA's bytes accessed (cost analysis: a loop body counted once), and
this script's estimate from the HLO text, split by where the op runs (the entry
computation, the body of a while loop, other called computations): every top-level op's
operand and result bytes (fusions as one op; parameters, constants, tuples, bitcasts and
get-tuple-elements move nothing). Then the ops by opcode and the largest ops of the
program with the JAX operation they come from. The exact step is a chain of programs
(`largebatch_jax/grouped.py`): each is shown on its own, and the totals count each as
often as a step runs it. `--dump` writes every program's HLO text.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.exact_bytes", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--config", default="configs/imagenet_8k.py")
    p.add_argument("--topology", default="v5e-8")
    p.add_argument("--per_chip_batch", type=int, default=32)
    p.add_argument("--set", default="", help="FIELD=VALUE,... overrides (configs/overrides.py)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--dump", default="")
    return p.parse_args(argv)


def roles(program) -> dict[str, str]:
    """computation name -> 'entry', 'while body', 'while condition' or 'called'."""
    found = {}
    for ins in program:
        if ins.opcode == "while":
            found[ins.attribute("body").lstrip("%")] = "while body"
            found[ins.attribute("condition").lstrip("%")] = "while condition"
    entry = program[-1].computation if program else ""
    found[entry] = "entry"
    return found


def top_level(program, role_of):
    """The ops of the entry and loop computations (not those inside fusions)."""
    return [
        ins
        for ins in program
        if role_of.get(ins.computation) in ("entry", "while body") and ins.opcode not in FREE
    ]


def traffic(ins, shapes, hlo) -> int:
    operands = sum(hlo.shape_bytes(shapes.get(o, "")) for o in ins.operands)
    return operands + hlo.shape_bytes(ins.shape)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    from largebatch_jax import host

    host.tpu_compiler_only()

    with host.plugin_noise_filtered():
        import jax
        import numpy as np

        from configs.overrides import apply_overrides
        from experiments.sweep import load_config
        from largebatch_jax import builder
        from largebatch_jax.aot import hlo, programs, targets

        jax.config.update("jax_enable_compilation_cache", False)
        target = targets.parse_topology(args.topology)
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.accelerator_type)
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        where = programs.site(target)
    devices = where.engine.num_devices
    print(f"{args.config} {args.set} on {target.name} ({devices} chips), jax {jax.__version__}")
    texts = {}
    for reduction in ("fast", "exact"):
        # The per-chip program of the big slice on a small one: kn = chips x the per-chip
        # batch, one micro-step.
        kn = args.per_chip_batch * devices
        config = apply_overrides(
            load_config(args.config), f"{args.set},reduction={reduction},batch_size={kn}"
        )
        training = builder.build_training(
            config, programs.plan_for(config, where), where.engine, abstract=True
        )
        batch = programs.batch_spec(
            where.engine, args.per_chip_batch, training.input_shape, np.uint8
        )
        compiled = training.train_step.lower(training.state, batch).compile()
        # A step is a chain of programs (one, or the exact step's: grouped.py); each is
        # read on its own, its bytes counted as often as a step runs it.
        parts = [(p.name, p.runs, p.program) for p in compiled.programs]
        total = collections.Counter()
        for name, runs, part in parts:
            cost = part.cost_analysis()
            cost = cost[0] if isinstance(cost, list | tuple) else cost
            total["bytes"] += runs * cost.get("bytes accessed", 0)
            total["flops"] += runs * cost.get("flops", 0)
            texts[f"{reduction}_{name}"] = part.as_text()
            describe(f"{reduction} {name} x {runs}", cost, part.as_text(), hlo, args.top)
        print(
            f"{reduction}: XLA bytes accessed per step {total['bytes'] / 1e9:.3f} GB, "
            f"FLOPs {total['flops'] / 1e9:.1f} G"
        )
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        for reduction, text in texts.items():
            (Path(args.dump) / f"train_{reduction}.hlo.txt").write_text(text)


def describe(name: str, cost: dict, text: str, hlo, top: int) -> None:
    """One compiled program: XLA's bytes and FLOPs, the estimate from its HLO by where
    the ops run and by kind, and its `top` largest ops."""
    program = hlo.parse(text)
    role_of = roles(program)
    shapes = {ins.name: ins.shape for ins in program}
    ops = top_level(program, role_of)
    by_role = collections.Counter()
    for ins in ops:
        by_role[role_of[ins.computation]] += traffic(ins, shapes, hlo)
    print(
        f"\n{name}: XLA bytes accessed {cost.get('bytes accessed', 0) / 1e9:.3f} GB, "
        f"FLOPs {cost.get('flops', 0) / 1e9:.1f} G; estimate from the HLO: "
        + ", ".join(f"{r} {b / 1e9:.3f} GB" for r, b in sorted(by_role.items()))
        + f"; {sum(1 for i in program if i.opcode == 'while')} while loop(s)"
    )
    kinds = collections.Counter()
    for ins in ops:
        kind = ins.opcode
        if ins.opcode == "fusion":
            kind += ":" + (ins.attribute("kind") or "?")
        kinds[(role_of[ins.computation], kind)] += traffic(ins, shapes, hlo)
    for (role, kind), b in kinds.most_common(12):
        print(f"  {role:10s} {kind:24s} {b / 1e9:8.3f} GB")
    print(f"  the {top} largest ops:")
    for ins in sorted(ops, key=lambda i: -traffic(i, shapes, hlo))[:top]:
        print(
            f"  {traffic(ins, shapes, hlo) / 1e6:9.1f} MB {role_of[ins.computation]:10s} "
            f"{ins.opcode:12s} {re.sub(r'{[^}]*}', '', ins.shape)[:60]:60s} "
            f"{ins.source[:70]}"
        )


if __name__ == "__main__":
    main()
