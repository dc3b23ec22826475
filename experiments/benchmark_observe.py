"""What observing a run costs and what it shows, from real `main.py` runs on fake CPU
devices (each a subprocess with its own workdir, the compilation cache in it as by
default):

- `profile`: the main job's first epoch (configs/fashion_mnist.py, 234 steps) with and
  without a trace of `--steps` steps, alternating, `--repeats` pairs: its training
  seconds (the clock pauses while the trace is written), its wall seconds, the median
  step time of its log intervals, and the seconds the trace took to write;
- `input`: the input-wait share of each log interval (the first, which starts the
  loader, left out) of the main job's first epoch, and of ResNet-50 at 224 on
  ImageNet-size photo JPEGs (synthesised 500x375 / 375x500, q=90) at 1 and 2 decoding
  threads;
- `compile`: the train step's compile time of a first run and of its resume (the same
  command with more epochs, the programs then loaded from WORKDIR/compilation_cache),
  for the main job and for ResNet-50 at 224.

    python -m experiments.benchmark_observe --what profile --repeats 3
    python -m experiments.benchmark_observe --what input compile

Data: Fashion-MNIST prepared in `--data_dir` (make data); the photo folder is made and
prepared there too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MAIN_EPOCH = (
    "--config=configs/fashion_mnist.py",
    "--config.num_epochs=1.0",
    "--config.decay_epochs=(0.34,0.67,0.89)",
)
RESNET50 = (
    "--config=configs/imagenet.py",
    "--config.dataset=image_folder/photos",
    "--config.num_classes=2",
    "--config.batch_size=8",
    "--config.bn_group_size=1",
    "--config.base_batch_size=8",
    "--config.eval_batch_size=8",
    "--config.eval_subset=8",
    "--config.log_every_steps=2",
    "--config.checkpoint_every_steps=1000",
    "--config.workers=0",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.benchmark_observe", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--what", nargs="+", default=["profile", "input", "compile"])
    p.add_argument("--data_dir", default=os.path.expanduser("~/tensorflow_datasets"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="profile: steps traced")
    p.add_argument("--resnet_steps", type=int, default=8, help="ResNet-50 steps per run")
    return p.parse_args(argv)


def main_py(workdir: Path, data_dir: str, *flags: str) -> tuple[str, float]:
    """One main.py run to its end on 8 fake CPU devices: its output and wall seconds."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    began = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "main.py",
            *flags,  # --config first: its fields' flags follow it
            f"--workdir={workdir}",
            f"--config.data_dir={data_dir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - began
    if out.returncode:
        raise SystemExit(f"main.py failed ({out.returncode}): {out.stderr[-3000:]}")
    return out.stdout + out.stderr, wall


def rows(workdir: Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "input_wait" in r]


def compile_seconds(log: str) -> float:
    return float(re.findall(r"compiled the train step in ([\d.]+) s", log)[-1])


def profile(args, scratch: Path) -> None:
    print(
        f"profile: the main job's first epoch, {args.steps} steps traced after 50, "
        f"{args.repeats} alternating pairs"
    )
    figures: dict[str, list] = {"off": [], "on": []}
    for r in range(args.repeats):
        for mode in ("off", "on"):
            workdir = scratch / f"profile_{mode}_{r}"
            flags = [f"--config.profile_steps={args.steps}", "--config.profile_after_steps=50"]
            _, wall = main_py(workdir, args.data_dir, *MAIN_EPOCH, *(flags if mode == "on" else []))
            result = json.loads((workdir / "result.json").read_text())
            steps = statistics.median(r["step_ms"] for r in rows(workdir)[1:])
            written = result["paused_seconds_this_session"].get("profile", 0.0)
            figures[mode].append((result["train_seconds"], wall, steps, written))
            print(
                f"  {mode:3s} repeat {r}: training {result['train_seconds']:.2f} s, wall "
                f"{wall:.1f} s, median interval step {steps:.1f} ms, trace written in "
                f"{written:.2f} s",
                flush=True,
            )
            shutil.rmtree(workdir)
    med = {m: [statistics.median(x[i] for x in v) for i in range(4)] for m, v in figures.items()}
    print(
        f"  medians: training {med['off'][0]:.2f} s off, {med['on'][0]:.2f} s on "
        f"({med['on'][0] / med['off'][0]:.3f}x); wall {med['off'][1]:.1f} s off, "
        f"{med['on'][1]:.1f} s on ({med['on'][1] / med['off'][1]:.3f}x); median interval "
        f"step {med['off'][2]:.1f} ms off, {med['on'][2]:.1f} ms on; trace written in "
        f"{med['on'][3]:.2f} s"
    )


def photo_folder(root: Path, data_dir: str) -> None:
    """ImageNet-size photo JPEGs, 2 classes x 32 train, x 4 val, prepared in data_dir."""
    from largebatch_jax.data import sources
    from largebatch_jax.data.photos import photo_jpeg

    for split, count in (("train", 32), ("val", 4)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                h, w = (375, 500) if i % 3 else (500, 375)
                seed = i + 100 * (c == "b") + 1000 * (split == "val")
                (root / split / c / f"{i}.jpg").write_bytes(photo_jpeg(h, w, seed=seed))
    sources.prepare("image_folder", data_dir, root=str(root), overwrite=True)


def shares(workdir: Path) -> str:
    waits = [r["input_wait"] for r in rows(workdir)[1:]]
    return (
        f"median {100 * statistics.median(waits):.1f}% (intervals: "
        + ", ".join(f"{100 * w:.1f}%" for w in waits)
        + ")"
    )


def resnet50(args, scratch: Path) -> tuple[Path, str, str]:
    """ResNet-50 at 224, 1 image per device: a first run at 1 decoding thread, then its
    resume at 2 (threads may change on resume), each `resnet_steps` steps."""
    photo_folder(scratch / "photos", args.data_dir)
    workdir = scratch / "resnet50"
    epochs = args.resnet_steps / 8  # 64 images, kn=8: 8 steps per epoch
    first, _ = main_py(
        workdir,
        args.data_dir,
        *RESNET50,
        f"--config.num_epochs={epochs}",
        "--config.decay_epochs=(0.7,)",
        "--config.threads=1",
    )
    one = shares(workdir)
    second, _ = main_py(
        workdir,
        args.data_dir,
        *RESNET50,
        f"--config.num_epochs={2 * epochs}",
        "--config.decay_epochs=(0.7,)",
        "--config.threads=2",
    )
    resumed = [r for r in rows(workdir) if r["step"] > args.resnet_steps]
    waits = [r["input_wait"] for r in resumed[1:]]
    two = (
        f"median {100 * statistics.median(waits):.1f}% (intervals: "
        + ", ".join(f"{100 * w:.1f}%" for w in waits)
        + ")"
    )
    print(f"  ResNet-50 224, 1 thread: {one}")
    print(f"  ResNet-50 224, 2 threads (the resumed run): {two}")
    return workdir, first, second


def processor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv=None) -> None:
    args = parse_args(argv)
    print(
        f"{processor()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    scratch = Path(tempfile.mkdtemp(prefix="benchmark_observe_"))
    try:
        if "profile" in args.what:
            profile(args, scratch)
        if "input" in args.what or "compile" in args.what:
            print("input wait (share of each log interval's training time, the first left out):")
            log, _ = main_py(scratch / "main", args.data_dir, *MAIN_EPOCH)
            print(f"  main job, first epoch: {shares(scratch / 'main')}", flush=True)
            first_main = compile_seconds(log)
            again, _ = main_py(
                scratch / "main",
                args.data_dir,
                *MAIN_EPOCH[:1],
                "--config.num_epochs=2.0",
                "--config.decay_epochs=(0.34,0.67,0.89)",
            )
            _, first, second = resnet50(args, scratch)
            print("compile time of the train step (first run, then its resume from the cache):")
            print(f"  main job: {first_main:.1f} s, resumed {compile_seconds(again):.1f} s")
            print(
                f"  ResNet-50 224: {compile_seconds(first):.1f} s, resumed "
                f"{compile_seconds(second):.1f} s"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
