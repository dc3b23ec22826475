"""Where the time goes: the log's timing figures (step time, input wait, TFLOP/s, MFU,
memory), the profile, the persistent compilation cache, TensorBoard serving a finished
run, and the loop's one host sync per log point."""

import gzip
import json
import re
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from experiments import tensorboard_server
from experiments.tensorboard_server import get_json
from largebatch_jax.aot import targets
from largebatch_jax.train import reporting
from largebatch_jax.train.profile import StepProfile
from largebatch_jax.utilization import Hardware, memory_in_use, step_flops
from tests.runs import LONGER, result, run

# ------------------------------------------------------------------ the figures


def test_achieved_flops_and_mfu_against_the_chips_peak():
    h100 = targets.accelerator_of("gpu", "NVIDIA H100 80GB HBM3")
    assert h100 is targets.gpu("h100") or h100 == targets.gpu("h100")
    assert targets.accelerator_of("tpu", "TPU v5 lite") == targets.CHIPS["v5e"]
    assert targets.accelerator_of("tpu", "TPU v5p") == targets.CHIPS["v5p"]
    assert targets.accelerator_of("tpu", "TPU v4") == targets.CHIPS["v4"]
    assert targets.accelerator_of("cpu", "cpu") is None
    # ResNet-50's 3 x 4.1 GFLOP per image, 256 images per GPU in 0.5 s:
    hw = Hardware(h100, flops_per_step=256 * 12.3e9, local_devices=())
    tflops, mfu = hw.tflops_and_mfu(steps=10, seconds=5.0)
    assert tflops == pytest.approx(6.2976)
    assert mfu == pytest.approx(6.2976e12 / 989.4e12)
    assert Hardware(None, None, ()).tflops_and_mfu(10, 5.0) is None  # CPU: no peak


def test_cpu_devices_show_no_flops_mfu_or_memory():
    """On CPU the log line has images/s, step time and input wait, and nothing it cannot
    know: there is no peak to compare with, and the runtime keeps no memory figures."""
    devices = jax.local_devices()
    hw = Hardware.of(devices, flops=lambda: pytest.fail("no FLOPs are counted on CPU"))
    assert hw.chip is None and hw.flops_per_step is None and hw.memory() is None
    line = reporting.describe_timing(
        {
            "images_per_sec": 4096.0,
            "images_per_sec_per_device": 512.0,
            "step_ms": 15.6,
            "input_wait": 0.031,
        }
    )
    assert line == "4096 img/s (512 per device), 15.6 ms/step, input wait 3%"
    gpu_line = reporting.describe_timing(
        {
            "images_per_sec": 2650.0,
            "images_per_sec_per_device": 331.0,
            "step_ms": 96.6,
            "input_wait": 0.02,
            "tflops_per_device": 112.3,
            "mfu": 0.1135,
            "peak_memory_gib": 12.25,
            "memory_limit_gib": 79.1,
        }
    )
    assert gpu_line.endswith("112.3 TFLOP/s per device, MFU 11.3%, memory 12.2 of 79.1 GiB")


def test_memory_in_use_takes_the_fullest_device():
    def device(peak, limit):
        return types.SimpleNamespace(
            memory_stats=lambda: {"peak_bytes_in_use": peak, "bytes_limit": limit}
        )

    assert memory_in_use([device(5, 80), device(9, 80), device(7, 80)]) == (9, 80)
    assert memory_in_use([types.SimpleNamespace(memory_stats=lambda: None)]) is None


def test_step_flops_counts_every_program_of_the_chain():
    """A program's FLOPs from XLA's cost analysis (2 m n k for a matmul), and a chain's
    (the exact mode's) as each program's times its runs."""
    x = jnp.ones((64, 32))
    w = jnp.ones((32, 16))
    matmul = jax.jit(lambda a, b: a @ b)
    lowered = matmul.lower(x, w)
    compiled = lowered.compile()
    program = types.SimpleNamespace
    one = program(programs=[program(program=lowered, runs=1, name="step")])
    assert step_flops(one, program(programs=[program(program=compiled)]), "cpu") == 2 * 64 * 32 * 16
    chain = program(programs=[program(program=lowered, runs=3, name="group")])
    done = program(programs=[program(program=compiled, runs=3, name="group")])
    assert step_flops(chain, done, "cpu") == 3 * 2 * 64 * 32 * 16


def test_profile_directories_and_steps(tmp_path):
    one = StepProfile.of(tmp_path, 3, 10, "first", 16, 0, 1)
    assert (one.directory, one.first, one.last) == (tmp_path / "profile", 27, 29)
    assert StepProfile.of(tmp_path, 3, 10, "first", 0, 1, 2).directory is None
    every = StepProfile.of(tmp_path, 3, 10, "all", 0, 1, 2)
    assert every.directory == tmp_path / "profile" / "process_1"
    assert StepProfile.of(tmp_path, 0, 10, "all", 0, 0, 1).directory is None


# ------------------------------------------------------------------ one host sync per log point


def _guarded_fetches(monkeypatch):
    """JAX's device-to-host transfer guard as GPUs and TPUs apply it, on CPU devices
    (whose arrays are on the host, so JAX guards nothing there): every fetch of an
    array's value (np.asarray, float, .item(), jax.device_get) raises while the guard
    disallows it."""
    from jax._src import array
    from jax._src import config as jax_config

    value = array.ArrayImpl._value

    def guarded(self):
        if jax_config.transfer_guard_device_to_host.value in ("disallow", "disallow_explicit"):
            raise RuntimeError("device-to-host transfer between log points")
        return value.fget(self)

    monkeypatch.setattr(array.ArrayImpl, "_value", property(guarded))


def _smoke(data_dir, **fields):
    from configs import smoke

    config = smoke.get_config()
    config.data_dir = data_dir
    config.prefetch_batches = 0
    for k, v in fields.items():
        config[k] = v
    return config


@pytest.mark.slow
def test_the_steps_between_log_points_fetch_nothing(tmp_path, fashion_mnist_dir, monkeypatch):
    """The loop runs under the transfer guard and lifts it only at log points,
    evaluations and checkpoints: the smoke run trains through it; the same loop with one
    per-step fetch added (a float() of the loss, as a per-step print would) stops at its
    first step."""
    from largebatch_jax import train
    from largebatch_jax.train.reporting import MetricLog

    _guarded_fetches(monkeypatch)
    done = train.train_and_evaluate(
        _smoke(fashion_mnist_dir, num_epochs=1.0, decay_epochs=(0.5, 0.75)), str(tmp_path / "a")
    )
    assert done["steps"] == 16

    add = MetricLog.add

    def add_and_print(self, step, metrics):
        print(f"step {step} loss {float(metrics['train_loss'])}")
        add(self, step, metrics)

    monkeypatch.setattr(MetricLog, "add", add_and_print)
    with pytest.raises(RuntimeError, match="device-to-host transfer between log points"):
        train.train_and_evaluate(
            _smoke(fashion_mnist_dir, num_epochs=1.0, decay_epochs=(0.5, 0.75)), str(tmp_path / "b")
        )


# ------------------------------------------------------------------ profile, cache, TensorBoard


def _trace_events(workdir: Path) -> list[dict]:
    traces = sorted(workdir.glob("profile/plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1, list(workdir.rglob("*"))
    assert list(traces[0].parent.glob("*.xplane.pb"))  # what TensorBoard's plugin reads
    return json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]


PROFILED = ("--config.profile_steps=3", "--config.profile_after_steps=4")


@pytest.mark.slow
def test_a_profile_and_the_compilation_cache_change_no_bit_and_tensorboard_serves_the_run(
    tmp_path, fashion_mnist_dir, straight
):
    """The 64-step smoke run traced for steps 5-7, its programs cached in its workdir (the
    default, JAX_COMPILATION_CACHE_DIR unset), ends with the params_sha256 of `straight`;
    so does the same run without any cache. The trace file holds the three steps'
    annotations and the input's. TensorBoard, started on the finished workdir, serves
    through its HTTP API (the routes its web page reads) the scalars, the config as text,
    the hyper-parameters and the profile (the trace viewer's events, grouped by step)."""
    profiled, uncached = tmp_path / "profiled", tmp_path / "uncached"
    out = run(
        profiled,
        fashion_mnist_dir,
        *LONGER,
        *PROFILED,
        extra_env={"JAX_COMPILATION_CACHE_DIR": None},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"tensorboard --logdir {profiled}" in out.stdout
    assert "profile of steps 5-7 written to " in out.stderr
    assert any((profiled / "compilation_cache").iterdir())  # the executables, kept
    plain = run(uncached, fashion_mnist_dir, *LONGER, "--config.compilation_cache=false")
    assert plain.returncode == 0, plain.stderr[-3000:]
    expected = result(straight)["params_sha256"]
    assert result(profiled)["params_sha256"] == result(uncached)["params_sha256"] == expected

    events = _trace_events(profiled)
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert steps == [5, 6, 7]
    names = {e.get("name") for e in events}
    # smoke prefetches: the loop waits on the queue; the prefetch thread loads and copies
    assert {"input_wait", "input_next", "host_to_device"} <= names

    server, base = tensorboard_server.start(profiled)
    try:
        tags = get_json(f"{base}/data/plugin/scalars/tags")["."]
        assert {"train_loss", "val_error_top1", "step_ms", "input_wait"} <= set(tags)
        loss = get_json(f"{base}/data/plugin/scalars/scalars?run=.&tag=train_loss")
        assert [step for _, step, _ in loss] == list(range(4, 65, 4))
        text = get_json(f"{base}/data/plugin/text/text?run=.&tag=config")
        assert "bn_group_size" in text[0]["text"]
        hparams = get_json(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        info = {h["name"]: h for h in hparams["hparamInfos"]}
        assert {"kn", "n", "k", "peak_lr", "warmup", "reduction", "dtype"} <= set(info)
        assert info["kn"]["domainInterval"]["minValue"] == 64.0
        assert info["warmup"]["domainDiscrete"] == ["gradual"]
        runs = get_json(f"{base}/data/plugin/profile/runs")
        assert len(runs) == 1 and runs[0].startswith("profile/"), runs
        assert "trace_viewer@" in get_json(f"{base}/data/plugin/profile/run_tools?run={runs[0]}")
        host = get_json(f"{base}/data/plugin/profile/hosts?run={runs[0]}&tag=trace_viewer@")
        trace = get_json(
            f"{base}/data/plugin/profile/data?run={runs[0]}&tag=trace_viewer@"
            f"&host={host[0]['hostname']}"
        )["traceEvents"]
        waits = [e for e in trace if e.get("name") == "input_wait"]
        assert sorted(e["args"]["group_id"] for e in waits) == [0, 1, 2]  # one per step
        assert {"input_next", "host_to_device"} <= {e.get("name") for e in trace}
    finally:
        server.kill()
        server.communicate()


def _photo_folder(root: Path, per_class: int, height: int, width: int) -> None:
    """2 classes of photo-like JPEGs (q=90) of `height` x `width` or the transpose, 8
    distinct ones repeated (decoding costs the same)."""
    from largebatch_jax.data.photos import photo_jpeg

    jpegs = [photo_jpeg(*((height, width) if i % 3 else (width, height)), seed=i) for i in range(8)]
    for split, count in (("train", per_class), ("val", 8)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(count):
                (root / split / c / f"{i}.jpg").write_bytes(jpegs[(i + (c == "b")) % 8])


PHOTOS = (
    "--config.dataset=image_folder/photos",
    "--config.num_classes=2",
    "--config.channels=3",
    "--config.model=resnet8",
    "--config.width=8",
    "--config.batch_size=32",
    "--config.bn_group_size=4",
    "--config.base_batch_size=32",
    "--config.train_subset=0",
    "--config.eval_subset=0",
    "--config.eval_batch_size=32",
    "--config.num_epochs=4.0",
    "--config.decay_epochs=(3.0,)",
    "--config.eval_every_epochs=4.0",
    "--config.checkpoint_every_steps=1000",
    "--config.log_every_steps=4",
    "--config.workers=0",
    "--config.prefetch_batches=0",
)


def _input_waits(workdir: Path) -> list[float]:
    from largebatch_jax.metrics import read_metrics

    return [r["input_wait"] for r in read_metrics(workdir) if "input_wait" in r]


@pytest.mark.slow
def test_the_input_wait_rises_where_the_input_is_the_bottleneck(tmp_path, fashion_mnist_dir):
    """One decoding thread feeding 8 devices large photo JPEGs (1200x900; a small model at
    16x16): the loop waits for its input most of the time, and one warning says so,
    naming the host's images/s and the knobs. The main job (configs/fashion_mnist.py, cut to 150
    steps) waits less than half the time and is not warned."""
    from largebatch_jax.data import sources

    data_dir = tmp_path / "tfds"
    _photo_folder(tmp_path / "photos", per_class=64, height=900, width=1200)
    sources.prepare("image_folder", str(data_dir), root=str(tmp_path / "photos"))
    bound = run(
        tmp_path / "bound", data_dir, *PHOTOS, "--config.image_size=16", "--config.threads=1"
    )
    assert bound.returncode == 0, bound.stderr[-3000:]
    waits = _input_waits(tmp_path / "bound")
    assert len(waits) == 4 and min(waits[1:]) > 0.5, waits
    warnings = [x for x in bound.stderr.splitlines() if "waited for its input" in x]
    assert len(warnings) == 1, bound.stderr[-3000:]
    assert re.search(r"delivered \d+ images/s \(32 per step\)", warnings[0]), warnings
    assert "config.workers (now 0 " in warnings[0] and "config.threads (now 1 " in warnings[0]

    main_job = run(
        tmp_path / "main",
        fashion_mnist_dir,
        "--config.train_subset=38400",  # 150 steps, logged every 50 as the main job is
        "--config.num_epochs=1.0",
        "--config.eval_subset=1024",
        "--config.decay_epochs=(0.5,0.75)",
        config="configs/fashion_mnist.py",
    )
    assert main_job.returncode == 0, main_job.stderr[-3000:]
    waits = _input_waits(tmp_path / "main")
    assert len(waits) == 3 and max(waits[1:]) < reporting.INPUT_WAIT_WARNING, waits
    assert "waited for its input" not in main_job.stderr
