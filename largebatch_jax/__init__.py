"""largebatch_jax: Goyal et al. 2017, 'Accurate, Large Minibatch SGD', in JAX/Flax.

Importing the package imports no JAX and changes no setting: entry points (main.py, the
tools) first choose the platform (`largebatch_jax.host`), then import the rest.
"""

__version__ = "0.1.0"
