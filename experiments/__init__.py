"""The experiments behind the results: sweeps, benchmarks and compile studies, each run
from the repository root as `python -m experiments.NAME` (configs/ and largebatch_jax/
import from there)."""
