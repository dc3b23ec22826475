"""The train step compiled for Cloud TPU slices and NVIDIA GPU clusters on this CPU host
(largebatch_jax.aot): it compiles as main.py would build it there, its only communication
is one all-reduce of exactly the gradients and BN statistics, its per-device memory does
not grow with the cluster (pure data parallelism); on GPU its convolutions are cuDNN
calls, it has no scatter or sort, the PTX assembler is the pip package's, and the exact
mode compiles with XLA's determinism options and no all-reduce."""

import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from configs import smoke
from largebatch_jax import builder, parallel
from largebatch_jax.aot import hlo, programs, targets
from largebatch_jax.plan import Facts, resolve
from tests.runs import env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _has_tpu_compiler() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def _has_gpu_compiler() -> bool:
    try:
        targets.gpu_compile_options()
    except ValueError:
        return False
    return True


# CI sets these: there the tests must run, not skip.
needs_tpu = pytest.mark.skipif(
    os.environ.get("REQUIRE_TPU_COMPILER") != "1" and not _has_tpu_compiler(),
    reason="the TPU compiler: pip install -e '.[tpu]'",
)
needs_gpu = pytest.mark.skipif(
    os.environ.get("REQUIRE_GPU_COMPILER") != "1" and not _has_gpu_compiler(),
    reason=f"the GPU compiler: {targets.GPU_COMPILER_INSTALL}",
)


def _ours(config, site) -> dict:
    """Our steps for `config` compiled on `site`, as the compile tool builds them."""
    return programs.compile_ours(config, programs.plan_for(config, site), site)


def _config(devices: int, per_device: int, accum_steps: int = 1, **fields):
    config = smoke.get_config()
    config.batch_size = devices * per_device
    config.accum_steps = accum_steps
    config.reduction = "fast"  # XLA's all-reduce; the exact mode's tests name reduction
    for k, v in fields.items():
        config[k] = v
    return config


def _bias_bytes_of_projection_bns(params) -> int:
    """A projection shortcut's BN bias and its block's last BN bias are added at the same
    point, so their gradients are the same array, which XLA sends once."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(
        leaf.size * 4
        for path, leaf in flat
        if "proj_bn" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path)
    )


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    # The session's compilation cache cannot hold executables for described devices
    # (each lookup fails with a warning); the other test modules keep it.
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)


@pytest.fixture(scope="module")
def v5e_2x2():
    return programs.site(targets.parse_topology("v5e:2x2"))


@pytest.fixture(scope="module")
def h100():
    """H100 clusters by 'hosts x GPUs', compiling with the pip package's PTX assembler."""
    options, _ = targets.gpu_compile_options()
    sites = {}

    def get(shape: str) -> programs.Site:
        if shape not in sites:
            sites[shape] = programs.site(targets.parse_topology(f"h100:{shape}"), options)
        return sites[shape]

    return get


def test_topology_names():
    assert targets.parse_topology("v5e-256").name == "v5e:16x16"
    assert targets.parse_topology("v5e-256").accelerator_type == "v5litepod-256"
    assert targets.parse_topology("v5e-32").shape == (4, 8)
    assert targets.parse_topology("v4-512").name == "v4:4x8x8"  # 2 cores per chip
    assert targets.parse_topology("v4-512").accelerator_type == "v4-512"
    assert targets.parse_topology("v5p-128").name == "v5:4x4x4"
    assert targets.parse_topology("v4:2x2x1").devices_count == 4
    cluster = targets.parse_topology("h100:32x8")
    assert (cluster.hosts, cluster.per_host, cluster.devices_count) == (32, 8, 256)
    assert cluster.platform == "cuda" and cluster.chip.memory_bytes == 84942979072
    assert targets.parse_topology("B200:1x8").chip.peak_bf16_flops == 2.25e15
    with pytest.raises(ValueError, match="--topology='a100-8'"):
        targets.parse_topology("a100-8")
    with pytest.raises(ValueError, match="--topology='h100:0x8'"):
        targets.parse_topology("h100:0x8")


def test_every_gpu_description_names_its_source_and_edit():
    for kind in targets.GPUS:
        text = (targets.GPU_DESCRIPTIONS / f"{targets.GPUS[kind][3]}.txtpb").read_text()
        assert re.search(r"^# Taken from openxla/xla, .*\.txtpb at commit$", text, re.M), kind
        assert "# Edit for this project:" in text, kind
        assert (
            "collective_memory_granularity" not in text.split("# Edit for")[1].split("\n\n", 1)[1]
        )


def test_hlo_shapes_and_collectives_are_read_from_the_text():
    text = (
        "ENTRY %main (p: f32[4]) -> f32[16] {\n"
        "  %all-reduce = (f32[]{:T(128)}, f32[3,3,8,8]{3,2,1,0}, bf16[10]{0}) all-reduce(%a)\n"
        "  %ag = ((f32[4]{0}), f32[16]{0}) all-gather-start(%b), dimensions={0}\n"
        "  ROOT %done = f32[16]{0} all-gather-done(%ag)\n"
        "}\n"
    )
    assert hlo.collectives(text) == [
        hlo.Collective("all-reduce", 4 + 4 * 576 + 2 * 10),
        hlo.Collective("all-gather", 64),
    ]


def test_the_audit_finds_cudnn_calls_scatters_and_layout_changes():
    text = """%fused_t (p0: f32[3,3,8,16]) -> f32[16,3,3,8] {
  %p0 = f32[3,3,8,16]{3,2,1,0} parameter(0)
  ROOT %transpose.1 = f32[16,3,3,8]{3,2,1,0} transpose(%p0), dimensions={3,0,1,2}
}

ENTRY %main (x: f32[2,8,8,8], w: f32[3,3,8,16], i: s32[2,1]) -> f32[2,8,8,16] {
  %x = f32[2,8,8,8]{3,2,1,0} parameter(0)
  %w = f32[3,3,8,16]{3,2,1,0} parameter(1)
  %t = f32[16,3,3,8]{3,2,1,0} fusion(%w), kind=kInput, calls=%fused_t
  %c = (f32[2,8,8,16], u8[0]) custom-call(%x, %t), custom_call_target="__cudnn$convForward"
  %g = f32[2,8,8,16]{3,2,1,0} get-tuple-element(%c), index=0
  %s = f32[2,8,8,16] scatter(%g, %i, %g), metadata={op_name="f/shard_map/take_along_axis"}
  ROOT %r = f32[2,16,8,8]{3,2,1,0} transpose(%s), dimensions={0,3,1,2}
}
"""
    a = hlo.audit(text)
    assert a.convolutions == {"forward": 1}
    assert a.convolution_bytes == 4 * (2 * 8 * 8 * 8 + 16 * 9 * 8 + 2 * 8 * 8 * 16)
    assert a.scatters == [("scatter", 2 * 8 * 8 * 16, "take_along_axis")]
    assert a.relayouts == {"before (filter)": (1, 4 * 16 * 9 * 8)}


def test_a_sort_xla_added_is_named_by_the_scatter_it_orders():
    text = """%fused_sort (p: s32[4]) -> s32[4] {
  %p = s32[4]{0} parameter(0)
  ROOT %sort.1 = s32[4]{0} sort(%p), dimensions={0}, to_apply=%cmp
}

%fused_scatter (a: f32[8], b: s32[4], c: f32[4]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = s32[4]{0} parameter(1)
  %c = f32[4]{0} parameter(2)
  ROOT %scatter.9 = f32[8]{0} scatter(%a, %b, %c), metadata={op_name="f/body/max_pool"}
}

ENTRY %main (i: s32[4], z: f32[8], u: f32[4]) -> f32[8] {
  %i = s32[4]{0} parameter(0)
  %z = f32[8]{0} parameter(1)
  %u = f32[4]{0} parameter(2)
  %sorted = s32[4]{0} fusion(%i), kind=kLoop, calls=%fused_sort
  ROOT %sc = f32[8]{0} fusion(%z, %sorted, %u), kind=kLoop, calls=%fused_scatter
}
"""
    assert hlo.audit(text).scatters == [
        ("sort", 4, "XLA, sorting the indices of the scatter from max_pool"),
        ("scatter", 8, "max_pool"),
    ]


# ------------------------------------------------------------------ TPU


@needs_tpu
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_tpu_all_reduce_carries_exactly_the_gradients_and_statistics(v5e_2x2, accum_steps):
    config = _config(4, 16, accum_steps)
    assert parallel.resolve_accum_loop(config.accum_loop, "tpu") == "scan"  # not the host's
    ours = _ours(config, v5e_2x2)
    train = ours["train"]
    assert train.flops > 0 and 0 < train.memory_bytes < targets.CHIPS["v5e"].memory_bytes
    assert [c.kind for c in train.collectives] == ["all-reduce"], train.collectives
    state = ours["state"]
    expected = programs.gradient_and_statistics_bytes(state)
    params = jax.tree.leaves(state.params)
    stats = jax.tree.leaves(state.batch_stats)
    assert expected == 4 * (sum(x.size for x in params) + sum(x.size for x in stats) + 2)
    if accum_steps == 1:  # straight-line code: XLA finds the identical bias gradients
        expected -= _bias_bytes_of_projection_bns(state.params)
    assert train.collectives[0].bytes == expected
    # Evaluation: one all-reduce of the four float32 sums.
    assert ours["eval"].collectives == [hlo.Collective("all-reduce", 16)]


_LOAD_TPU_COMPILER_AND_WAIT = """
import sys
from largebatch_jax import host
host.tpu_compiler_only()
from largebatch_jax.aot import programs, targets
programs.site(targets.parse_topology("v5e:2x2"))
print("loaded", flush=True)
sys.stdin.readline()
"""


@needs_tpu
def test_two_processes_load_the_tpu_compiler_at_once(tmp_path):
    """pytest -n 2 and a compile beside a test run: libtpu's host-wide lock (for processes
    that share chips) would refuse the second process."""
    command = [sys.executable, "-c", _LOAD_TPU_COMPILER_AND_WAIT]
    first_err = tmp_path / "first.err"
    with first_err.open("w") as err:
        first = subprocess.Popen(
            command, cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=err, text=True,
        )  # fmt: skip
    try:
        ready, _, _ = select.select([first.stdout], [], [], 120)
        assert ready and first.stdout.readline() == "loaded\n", first_err.read_text()[-2000:]
        second = subprocess.run(
            command, cwd=ROOT, env=env(), input="\n", capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 0 and second.stdout == "loaded\n", second.stderr[-2000:]
        first.communicate("\n", timeout=60)
        assert first.returncode == 0, first_err.read_text()[-2000:]
    finally:
        first.kill()  # a no-op once it has exited


@needs_tpu
def test_tpu_accumulation_costs_are_counted_for_every_micro_step(v5e_2x2):
    one = _ours(_config(4, 8), v5e_2x2)["train"]
    two = _ours(_config(4, 16, 2), v5e_2x2)["train"]
    # Twice the images in two micro-steps of the same size: twice the model's FLOPs.
    assert 1.9 < two.flops / one.flops < 2.1


@needs_tpu
def test_tpu_per_chip_memory_does_not_grow_with_the_slice(v5e_2x2):
    small = _ours(_config(4, 16), v5e_2x2)["train"]
    large_site = programs.site(targets.parse_topology("v5e:4x4"))
    large = _ours(_config(16, 16), large_site)["train"]
    for field in ("argument_bytes", "output_bytes", "temp_bytes"):
        assert getattr(large, field) == getattr(small, field), field
    assert large.flops == pytest.approx(small.flops, rel=1e-3)
    assert [c.bytes for c in large.collectives] == [c.bytes for c in small.collectives]


@needs_tpu
def test_largest_micro_batch_doubles_until_it_does_not_fit(v5e_2x2, monkeypatch):
    config = _config(4, 64)
    sizes = []
    real_fits = programs.fits

    def fits(config, where, micro):
        sizes.append(micro)
        return object() if micro <= 16 else None

    monkeypatch.setattr(programs, "fits", fits)
    assert programs.largest_micro_batch(config, v5e_2x2) == 16
    assert sizes == [4, 8, 16, 32]
    assert programs.with_micro_batch(config, 4, 16).accum_steps == 4
    with pytest.raises(ValueError, match="per-device batch 3"):
        programs.with_micro_batch(config, 4, 3)
    # The real check compiles: 16 images per chip of the smoke model fit a v5e easily.
    compiled = real_fits(config, v5e_2x2, 16)
    assert compiled is not None and np.isfinite(compiled.roofline_s(targets.CHIPS["v5e"]))


# ------------------------------------------------------------------ GPU


@needs_gpu
def test_gpu_step_compiles_with_cudnn_and_all_reduces_exactly_the_gradients(h100):
    config = _config(4, 8)
    ours = _ours(config, h100("2x2"))
    train = ours["train"]
    conv_layers = sum(
        1
        for path, _ in jax.tree_util.tree_flatten_with_path(ours["state"].params)[0]
        if "conv" in jax.tree_util.keystr(path)
    )
    # Every convolution, forward and both backward ones, is a cuDNN call (the stem's
    # needs no input gradient).
    assert (
        train.audit.convolutions.get("forward", 0)
        + train.audit.convolutions.get("forward with fused bias/activation", 0)
        == conv_layers
    )
    assert train.audit.convolutions["backward filter"] == conv_layers
    assert train.audit.convolutions["backward input"] == conv_layers - 1
    assert train.audit.scatters == []  # no scatter, select-and-scatter or sort on GPU
    assert {c.kind for c in train.collectives} == {"all-reduce"}
    expected = programs.gradient_and_statistics_bytes(ours["state"])
    expected -= _bias_bytes_of_projection_bns(ours["state"].params)
    assert sum(c.bytes for c in train.collectives) == expected
    assert train.flops > 0 and train.bytes_accessed > train.audit.convolution_bytes
    assert ours["eval"].collectives == [hlo.Collective("all-reduce", 16)]


@needs_gpu
def test_gpu_per_device_memory_is_the_same_on_one_host_and_on_two(h100):
    one = _ours(_config(2, 8), h100("1x2"))["train"]
    two = _ours(_config(4, 8), h100("2x2"))["train"]
    for field in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes"):
        assert getattr(two, field) == getattr(one, field), field
    assert [c.bytes for c in two.collectives] == [c.bytes for c in one.collectives]


@needs_gpu
def test_gpu_exact_step_compiles_deterministic_without_all_reduce(h100, monkeypatch):
    jit_options = []
    real_jit = jax.jit

    def jit(fn, **kwargs):
        jit_options.append(kwargs.get("compiler_options"))
        return real_jit(fn, **kwargs)

    monkeypatch.setattr(jax, "jit", jit)
    config = _config(4, 8, reduction="exact")
    site = h100("2x2")
    training = builder.build_training(
        config, programs.plan_for(config, site), site.engine, abstract=True
    )
    # The builder compiles XLA's determinism option into both steps itself on GPU (the
    # train step's four programs, largebatch_jax/grouped.py, and the eval step) ...
    assert jit_options == [{"xla_gpu_deterministic_ops": True}] * 5
    batch = programs.batch_spec(h100("2x2").engine, 8, training.input_shape, np.uint8)
    exact = programs.analyse(
        training.train_step.lower(training.state, batch), "cuda", h100("2x2").options
    )
    kinds = [c.kind for c in exact.collectives]
    assert "all-reduce" not in kinds and kinds.count("all-to-all") == 1, kinds
    assert exact.audit.scatters == []  # nothing for XLA's determinism to sort
    # ... and on CPU nothing.
    jit_options.clear()
    on_cpu = resolve(config, Facts(devices=4, platform="cpu"))
    builder.build_training(config, on_cpu, site.engine, abstract=True)
    assert jit_options == [None] * 5


@needs_gpu
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace (Debian's strace)")
def test_gpu_compile_runs_the_pip_ptx_assembler(tmp_path):
    """The command compiles without a GPU, with the PTX assembler of the gpu-compiler
    extra (every ptxas it runs is that one), not a CUDA toolkit the machine has."""
    trace = tmp_path / "execve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    out = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=execve", "-o", str(trace), sys.executable,
         "-m", "largebatch_jax.aot", "--config=configs/smoke.py", "--topology=h100:1x2",
         "--per_device_batch=8", "--config.reduction=fast"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    ptxas = targets.packaged_ptxas()
    run = re.findall(r'execve\("([^"]*ptxas)", .*\) = 0', trace.read_text())
    assert run and set(run) == {str(ptxas)}, sorted(set(run))
    assert f"PTX assembler {ptxas} (CUDA 12." in out.stdout
    assert "cuDNN convolutions: 26" in out.stdout
    assert out.stderr == "", out.stderr  # no plugin noise around the figures
