"""What the GPU step's scatter-free forms change in the compiled GPU program: ResNet-50,
the paper's run (kn=8192, n=32, 32 per GPU on 32 x 8 H100), compiled on this CPU host as
main.py builds it on GPU, and again with the forms main.py uses elsewhere (XLA's
select-and-scatter for the max-pool's gradient, optax's gather for the label's logit, a
top-k for the training error), fast and exact mode, float32 and bfloat16.

    python -m experiments.aot_scatter_free > experiments/results/aot_scatter_free.txt
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

if __name__ == "__main__":  # no options; --help says what it compiles, before JAX starts
    argparse.ArgumentParser(
        prog="python -m experiments.aot_scatter_free", description=__doc__.split("\n\n")[0]
    ).parse_args()
os.environ["JAX_PLATFORMS"] = "cpu"

from largebatch_jax import host

with host.plugin_noise_filtered():
    import jax

    from configs import imagenet_8k
    from largebatch_jax import builder, parallel
    from largebatch_jax.aot import programs, report, targets

    jax.devices()


def main() -> int:
    jax.config.update("jax_enable_compilation_cache", False)
    options, assembler = targets.gpu_compile_options()
    where = programs.site(targets.parse_topology("h100:32x8"), options)
    print(f"ResNet-50 kn=8192 n=32 on h100:32x8, 32 per GPU | jax {jax.__version__} | {assembler}")
    for dtype in ("float32", "bfloat16"):
        for reduction in ("fast", "exact"):
            config = imagenet_8k.get_config()
            config.dtype, config.reduction, config.eval_batch_size = dtype, reduction, 8192
            for forms in ("scatter-free (GPU)", "with scatters (CPU/TPU forms)"):
                cpu_forms = forms.startswith("with")
                # The model and the step ask parallel.is_gpu which forms to use; the exact
                # mode's XLA options stay the GPU's either way.
                gpu = not cpu_forms
                plan = programs.plan_for(config, where)
                with mock.patch.object(parallel, "is_gpu", lambda p, gpu=gpu: gpu):
                    training = builder.build_training(config, plan, where.engine, abstract=True)
                batch = programs.batch_spec(where.engine, 32, training.input_shape, "uint8")
                lowered = training.train_step.lower(training.state, batch)
                extra = {"xla_gpu_deterministic_ops": True} if reduction == "exact" else {}
                compiled = programs.analyse(lowered, "cuda", {**options, **extra})
                print(f"\n{dtype}, reduction={reduction}, {forms}")
                print(
                    f"  temporaries {report.size(compiled.temp_bytes)}, memory "
                    f"{report.size(compiled.memory_bytes)}, bytes accessed "
                    f"{compiled.bytes_accessed / 1e9:.3f} GB, roofline "
                    f"{1e3 * compiled.roofline_s(where.target.chip):.2f} ms"
                )
                print(next(x for x in report.describe_audit(compiled.audit) if "scatter" in x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
