"""What accelerators this host has, and the set-up entry points do before JAX starts.

Importing this module imports no JAX and changes nothing; main.py and the tools call
`choose_platforms`, `quiet_native_logs` and `plugin_noise_filtered` first, and what
compiles for TPU slices without one (the compile tool, the tests) `tpu_compiler_only`. JAX imports
every installed accelerator plugin (the CUDA plugin's extension modules load with
`import jax`, libtpu with the first backend), and on a host without the hardware they
print start-up errors and banners before the program's own first line. With
`JAX_PLATFORMS=cpu` JAX starts no accelerator backend, so nothing probes for chips or
drivers; what the plugins' native code still writes while loading is filtered out of
stderr, line by line, by exact pattern, everything else is passed on.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, MutableMapping
from pathlib import Path

# Device nodes of an NVIDIA driver (bare metal, containers, WSL2).
NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
# PCI ids of Cloud TPU chips (vendor Google, 0x1ae0; its other devices, e.g. the gVNIC
# network card, are not TPUs).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")

# The install commands for the accelerators main.py trains on (README, "Set-up").
INSTALL = {
    "cuda": "pip install -e '.[cuda12]'",
    "tpu": "pip install -e '.[tpu]'",
}

# Lines accelerator plugins (and TensorFlow, which tfds imports) print on a host
# without the hardware, or at every start: INFO banners, never errors.
PLUGIN_NOISE = (
    # absl's preface to the first log line of each native library that logs before
    # absl::InitializeLog (the line it precedes is judged by the patterns below).
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written"),
    # jax-cuda12-plugin's extension modules, loaded by `import jax`, look for a driver.
    re.compile(r"^I\d{4} .*cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"),
    # TensorFlow's start-up banners.
    re.compile(r"^I\d{4} .*port\.cc:\d+\] oneDNN custom operations are on"),
    re.compile(r"^I\d{4} .*cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized"),
    re.compile(r"^To enable the following instructions: .* in other operations, rebuild"),
)


def visible_accelerators(root: str = "/") -> tuple[str, ...]:
    """The accelerator platforms whose hardware this host exposes: 'cuda' (an NVIDIA
    driver's device nodes), 'tpu' (Cloud TPU chips on the PCI bus). Reads only files."""
    base = Path(root)
    found = []
    if any((base / node.lstrip("/")).exists() for node in NVIDIA_DEVICE_NODES):
        found.append("cuda")
    for vendor in (base / "sys/bus/pci/devices").glob("*/vendor"):
        try:
            if vendor.read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            if (vendor.parent / "device").read_text().strip() in TPU_PCI_DEVICES:
                found.append("tpu")
                break
        except OSError:
            continue
    return tuple(found)


def choose_platforms(
    environ: MutableMapping[str, str] | None = None, accelerators: tuple[str, ...] | None = None
) -> str | None:
    """`JAX_PLATFORMS=cpu` where the user set none and the host has no accelerator, so
    that JAX probes no plugin (libtpu's and the CUDA plugin's start-up errors on a CPU
    host). Where the hardware is there, JAX chooses as usual. Before jax is imported.
    Returns the value set, or None."""
    env = os.environ if environ is None else environ
    if env.get("JAX_PLATFORMS"):
        return None
    if visible_accelerators() if accelerators is None else accelerators:
        return None
    env["JAX_PLATFORMS"] = "cpu"
    return "cpu"


def quiet_native_logs(environ: MutableMapping[str, str] | None = None) -> bool:
    """`TF_CPP_MIN_LOG_LEVEL=1` where the user set none: the native logs of TensorFlow
    (which tfds imports, at any point of a run), XLA and the accelerator plugins keep
    their warnings and errors but drop their INFO banners (oneDNN, CPU features, CUDA
    drivers), each of which would also bring absl's "before InitializeLog" preface.
    Before TensorFlow or jax is imported. Returns whether it set the variable."""
    env = os.environ if environ is None else environ
    if "TF_CPP_MIN_LOG_LEVEL" in env:
        return False
    env["TF_CPP_MIN_LOG_LEVEL"] = "1"
    return True


def tpu_compiler_only(environ: MutableMapping[str, str] | None = None) -> None:
    """For a process that compiles for TPU slices and runs nothing on one (the compile
    tool, the tests): libtpu neither asks the GCE metadata server for the host's TPU nor
    takes its host-wide lock, which is meant for processes sharing real chips and lets only
    one process per host load the compiler. Before libtpu loads; the user's values win."""
    env = os.environ if environ is None else environ
    env.setdefault("TPU_SKIP_MDS_QUERY", "1")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def is_plugin_noise(line: str) -> bool:
    return any(p.search(line) for p in PLUGIN_NOISE)


# The console's stderr while `plugin_noise_filtered` captures descriptor 2 (None outside).
_CONSOLE_STDERR: int | None = None


def write_stderr(text: str) -> None:
    """Write `text` to the console's stderr at once, also while `plugin_noise_filtered`
    captures it (from a signal handler that exits before the capture is written out)."""
    sys.stderr.flush()
    os.write(2 if _CONSOLE_STDERR is None else _CONSOLE_STDERR, text.encode())


@contextlib.contextmanager
def plugin_noise_filtered() -> Iterator[None]:
    """Run the block with file descriptor 2 captured; afterwards write out, in order,
    every captured line that is not `PLUGIN_NOISE`. Native libraries write to the
    descriptor, not to `sys.stderr`, so only this catches them; wrap the imports and the
    backend start, which are short, not the run."""
    global _CONSOLE_STDERR
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        _CONSOLE_STDERR = saved
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            _CONSOLE_STDERR = None
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            kept = [x for x in text.splitlines(keepends=True) if not is_plugin_noise(x)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def cpu_only_warning(
    platform: str, devices: int, model: str, image_size: int, accelerators: tuple[str, ...]
) -> str | None:
    """One line when an ImageNet-size run (inputs of 128 x 128 or more) is about to
    train on CPU devices only, naming the install command for the host's hardware."""
    if platform != "cpu" or image_size < 128:
        return None
    if accelerators:
        kind = accelerators[0]
        return (
            f"warning: {model} at {image_size}x{image_size} is about to train on {devices} "
            f"CPU device(s): this host has {'an NVIDIA GPU' if kind == 'cuda' else 'TPU chips'} "
            f"but JAX has no backend for it; install one with {INSTALL[kind]}."
        )
    return (
        f"warning: {model} at {image_size}x{image_size} is about to train on {devices} CPU "
        f"device(s): JAX sees no GPU or TPU here (NVIDIA GPUs: {INSTALL['cuda']}; a Cloud "
        f"TPU VM: {INSTALL['tpu']})."
    )
