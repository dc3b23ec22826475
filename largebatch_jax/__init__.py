"""largebatch_jax: Goyal et al. 2017, 'Accurate, Large Minibatch SGD', in JAX/Flax."""

import jax as _jax

# One random stream for every program that imports the package (runs, tests, notebooks),
# so a seed gives the same initial weights everywhere. The non-partitionable threefry is
# chosen because the partitionable one (JAX's default) compiles pathologically slowly on
# XLA:CPU for some shapes (measured: 5.8 s vs 0.4 s for a 3x3x8x16 kernel; ResNet-50 init
# 16 s vs 10 s). Only sharded random generation would need it, and the project does none.
_jax.config.update("jax_threefry_partitionable", False)

__version__ = "0.1.0"
