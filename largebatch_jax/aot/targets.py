"""The hardware `largebatch_jax.aot` compiles for: Cloud TPU slices and NVIDIA GPU
clusters, their published per-device figures, and their devices as JAX describes them on
a host that has none of them."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import subprocess
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device's published figures: dense bf16 peak, memory bandwidth and size."""

    name: str
    peak_bf16_flops: float  # FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: int


@dataclasses.dataclass(frozen=True)
class TpuChip(Accelerator):
    cores_per_chip: int  # slice names count TensorCores (v4-512 = 256 chips)
    chip_config: str  # get_topology_desc's chip_config_name
    dims: int  # 2-D (v5e) or 3-D (v4, v5p) torus
    topology_prefix: str


@dataclasses.dataclass(frozen=True)
class Gpu(Accelerator):
    description: str  # the GpuTargetConfigProto file in gpus/, without .txtpb


CHIPS = {
    "v4": TpuChip("TPU v4", 275e12, 1.2e12, 32 * 2**30, 2, "megacore", 3, "v4"),
    "v5e": TpuChip("TPU v5e", 197e12, 819e9, 16 * 2**30, 1, "default", 2, "v5e"),
    "v5p": TpuChip("TPU v5p", 459e12, 2.76e12, 95 * 2**30, 2, "megacore", 3, "v5"),
}
_ALIASES = {"v5litepod": "v5e", "v5": "v5p"}

GPU_DESCRIPTIONS = Path(__file__).parent / "gpus"


def _gpu(name: str, peak: float, bandwidth: float, description: str) -> Gpu:
    """NVIDIA's data-sheet peak (dense, no sparsity) and bandwidth; the memory XLA's
    description of the GPU gives (what the compiler plans against)."""
    text = (GPU_DESCRIPTIONS / f"{description}.txtpb").read_text()
    memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
    return Gpu(name, peak, bandwidth, memory, description)


GPUS = {
    "a100-40": ("NVIDIA A100 SXM4 40GB", 312e12, 1.555e12, "a100_sxm_40"),
    "a100": ("NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, "a100_sxm_80"),
    "h100": ("NVIDIA H100 SXM5 80GB", 989.4e12, 3.35e12, "h100_sxm"),
    "h200": ("NVIDIA H200 SXM 141GB", 989.4e12, 4.8e12, "h200"),
    "b200": ("NVIDIA B200 (HGX)", 2.25e15, 8.0e12, "b200"),
}


def gpu(kind: str) -> Gpu:
    return _gpu(*GPUS[kind])


def gpu_kind_of(device_kind: str) -> str | None:
    """The `GPUS` key of a JAX device's `device_kind` ('NVIDIA H100 80GB HBM3' -> 'h100'),
    or None for a GPU without a description here."""
    name = device_kind.upper()
    for key, model in (("b200", "B200"), ("h200", "H200"), ("h100", "H100"), ("a100", "A100")):
        if model in name:
            return "a100-40" if key == "a100" and "40GB" in name else key
    return None


def accelerator_of(platform: str, device_kind: str) -> Accelerator | None:
    """The published figures of a live JAX device ('gpu' 'NVIDIA H100 80GB HBM3', 'tpu'
    'TPU v5 lite'), or None where there are none here (CPU, another chip)."""
    if platform in ("gpu", "cuda"):
        kind = gpu_kind_of(device_kind)
        return gpu(kind) if kind else None
    if platform != "tpu":
        return None
    name = device_kind.lower()
    if "lite" in name or "v5e" in name:
        return CHIPS["v5e"]
    if "v5" in name:  # 'TPU v5p', 'TPU v5'
        return CHIPS["v5p"]
    return CHIPS["v4"] if "v4" in name else None


@dataclasses.dataclass(frozen=True)
class Slice:
    """A Cloud TPU slice: a torus of chips."""

    chip: TpuChip
    shape: tuple[int, ...]  # chips along each torus axis
    platform = "tpu"

    @property
    def devices_count(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        return f"{self.chip.topology_prefix}:{'x'.join(map(str, self.shape))}"

    @property
    def accelerator_type(self) -> str:
        """Cloud TPU's name of the slice: v5litepod-256, v4-512 (TensorCores), v5p-128."""
        prefix = {"v5e": "v5litepod", "v5": "v5p"}.get(self.chip.topology_prefix, "v4")
        return f"{prefix}-{self.devices_count * self.chip.cores_per_chip}"

    def devices(self) -> list:
        """The slice's devices as JAX describes them on a host that has none of them."""
        from jax.experimental import topologies

        dims = self.shape + (1,) * (3 - len(self.shape))
        # Torus links: a 3-D slice wraps an axis of 4 or more chips; a v5e slice only wraps
        # the full pod's 16-chip axes (libtpu rejects wrap on a v5e:4x8).
        if self.chip.dims == 3:
            wrap = tuple(d >= 4 for d in dims)
        else:
            wrap = (dims[0] == 16, dims[1] == 16, False)
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=self.name,
            chip_config_name=self.chip.chip_config,
            chips_per_host_bounds=(2, 2, 1),
            num_slices=1,
            wrap=wrap,
        )
        return list(desc.devices)


@dataclasses.dataclass(frozen=True)
class GpuCluster:
    """`hosts` servers of `per_host` NVIDIA GPUs each (the paper's: 32 x 8 P100)."""

    chip: Gpu
    kind: str
    hosts: int
    per_host: int
    platform = "cuda"

    @property
    def devices_count(self) -> int:
        return self.hosts * self.per_host

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.hosts}x{self.per_host}"

    def devices(self) -> list:
        """The cluster's GPUs as XLA's GPU compiler describes them without a GPU (its
        description file); JAX's process index is the host."""
        from jax.experimental import topologies

        text = (GPU_DESCRIPTIONS / f"{self.chip.description}.txtpb").read_text()
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=text, topology=f"1x{self.hosts}x{self.per_host}"
        )
        return list(desc.devices)


Target = Slice | GpuCluster


def slice_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The usual torus of a slice of `chips` chips: start from one host's 2x2 and double
    the shortest axis (v5e-256 -> 16x16, v4-512 = 256 chips -> 4x8x8)."""
    if chips < 4 or chips & (chips - 1):
        raise ValueError(f"a slice of {chips} chips: use a power of two >= 4.")
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        shape[shape.index(min(shape))] *= 2
        shape.sort()
    return tuple(shape) if dims == 2 else tuple(sorted(shape[:2]) + shape[2:])


def parse_topology(text: str) -> Target:
    """A TPU slice: 'v5e-256', 'v4-512', 'v5p-128' (slice names: v5e counts chips, v4/v5p
    count TensorCores) or a torus 'v5e:4x8', 'v4:4x8x8' (chips per axis); or an NVIDIA
    GPU cluster 'h100:32x8' (hosts x GPUs per host; a100, a100-40, h100, h200, b200)."""
    cleaned = text.strip().lower()
    m = re.fullmatch(r"([a-z][\w-]*?):(\d+)x(\d+)", cleaned)
    if m and m.group(1) in GPUS:
        hosts, per_host = int(m.group(2)), int(m.group(3))
        if hosts < 1 or per_host < 1:
            raise ValueError(f"--topology={text!r}: hosts and GPUs per host must be >= 1.")
        return GpuCluster(gpu(m.group(1)), m.group(1), hosts, per_host)
    m = re.fullmatch(r"(v\w+?)([-:])(\d+(?:x\d+)*)", cleaned)
    generation = _ALIASES.get(m.group(1), m.group(1)) if m else None
    if generation not in CHIPS:
        raise ValueError(
            f"--topology={text!r} is neither a TPU slice nor a GPU cluster: write e.g. "
            f"v5e-256, v4-512, v5e:4x8, v4:4x8x8 (TPU: {', '.join(CHIPS)}) or h100:32x8, "
            f"a100:1x8 (hosts x GPUs per host: {', '.join(GPUS)})."
        )
    chip = CHIPS[generation]
    if m.group(2) == "-":
        cores = int(m.group(3))
        if cores % chip.cores_per_chip:
            raise ValueError(f"--topology={text!r}: {chip.name} slices count 2 cores per chip.")
        return Slice(chip, slice_shape(cores // chip.cores_per_chip, chip.dims))
    shape = tuple(int(d) for d in m.group(3).split("x"))
    if len(shape) != chip.dims:
        raise ValueError(f"--topology={text!r}: a {chip.name} torus has {chip.dims} axes.")
    return Slice(chip, shape)


# Where pip puts the CUDA toolkit's PTX assembler: nvidia-cuda-nvcc-cu12 (the project's
# gpu-compiler extra) and CUDA 13's nvidia-cuda-nvcc.
_PTXAS_IN_PACKAGES = (("nvidia.cuda_nvcc", "bin/ptxas"), ("nvidia.cu13", "bin/ptxas"))


def packaged_ptxas() -> Path | None:
    """The PTX assembler of a pip-installed CUDA toolkit package, or None. The compile
    uses this one, never a toolkit the machine happens to have in /usr/local/cuda."""
    for package, relative in _PTXAS_IN_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            continue
        for location in spec.submodule_search_locations or () if spec else ():
            path = Path(location) / relative
            if path.is_file():
                return path
    return None


def ptxas_version(path: Path) -> str:
    """'12.9.86' from `ptxas --version` ('... Cuda compilation tools, release 12.9, V12.9.86')."""
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"V(\d+\.\d+\.\d+)", out.stdout)
    return m.group(1) if m else "unknown"


GPU_COMPILER_INSTALL = "pip install -e '.[gpu-compiler]'"


def gpu_compile_options(ptxas: Path | None = None) -> tuple[dict[str, str], str]:
    """The XLA options of a GPU compile on this host, which take the PTX assembler from
    `ptxas`'s toolkit directory first (default: the pip package's; XLA's own search also
    looks in /usr/local/cuda), and a line naming that assembler; a ValueError naming the
    install where JAX's CUDA plugin or the assembler is missing."""
    plugin = any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")
    )
    ptxas = ptxas or packaged_ptxas()
    if not plugin or ptxas is None or not ptxas.is_file():
        raise ValueError(
            "--topology: compiling for NVIDIA GPUs needs JAX's CUDA plugin and a PTX "
            f"assembler from pip (missing: {'the plugin' if not plugin else 'ptxas'}): "
            f"{GPU_COMPILER_INSTALL}."
        )
    line = f"PTX assembler {ptxas} (CUDA {ptxas_version(ptxas)})"
    return {"xla_gpu_cuda_data_dir": str(ptxas.parent.parent)}, line
