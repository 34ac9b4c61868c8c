"""Test configuration shared by the whole suite."""

import jax

# Compiling partitionable threefry sampling of multi-dimensional shapes takes
# ~10 s per shape on XLA-CPU (jax 0.10); the classic scheme compiles in <1 s.
jax.config.update("jax_threefry_partitionable", False)
