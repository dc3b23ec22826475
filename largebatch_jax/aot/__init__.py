"""Compile the real train and eval steps for a Cloud TPU slice or an NVIDIA GPU cluster on
any CPU host, without the hardware.

    pip install -e '.[tpu]'            # the TPU compiler (libtpu)
    pip install -e '.[gpu-compiler]'   # JAX's CUDA plugin and a PTX assembler, from pip
    python -m largebatch_jax.aot --config=configs/imagenet_8k.py --topology=v5e-256
    python -m largebatch_jax.aot --config=configs/imagenet_8k.py --topology=h100:32x8 \\
        --config.dtype=bfloat16 --reference
    python -m largebatch_jax.aot --config=configs/imagenet_8k.py --topology=h100:1x8 \\
        --per_device_batch=max

JAX describes the target's devices without any of them (`jax.experimental.topologies`;
for a GPU from XLA's description of it, `gpus/`), the shared builder wires the config
exactly as main.py would there (mesh over the target's devices; the accumulation loop,
the max-pool's gradient and the exact mode's XLA options resolved for its platform), and
the compiler reports per device: memory against the device's, FLOPs and bytes accessed
(`programs.COST_SOURCES` says from where), every collective, and for a GPU program its
cuDNN calls, scatters, sorts and layout changes (`hlo.audit`). From those, a roofline
lower bound on the step time, max(FLOPs / peak, bytes / memory bandwidth), and so an upper
bound on images/s. `--reference` compiles the Flax-example-style step beside it.

Modules: `targets` (the hardware), `programs` (what is compiled and measured), `hlo`
(reading the compiled program), `report` (the text), `__main__` (the command).
"""
