"""Sweeps on a device mesh: the client axis split over devices, also across hosts."""

from typing import Any

import chex
import jax
import numpy as np
from jax.experimental import multihost_utils

from pflax._src.simulation import engine
from pflax._src.training import mapping


def strategy(name: str, sharded: bool = False) -> str:
  """Client mapping inside a sweep: `pflax.train`'s strategies, resolved.

  "auto" is the backend's default (`pflax.train.default_strategy`: "loop" on
  CPU, "vmap" on accelerators), or "vmap" on a mesh, where the whole round is
  one program partitioned over the devices; "loop" cannot be sharded.
  """
  if sharded and name == "loop":
    raise ValueError("a sharded sweep maps clients inside one program: strategy "
                     f"must be 'auto', 'vmap' or 'map', got {name!r}.")
  if sharded and name == "auto":
    return "vmap"
  return mapping.resolve_strategy(name)


def check_mesh(mesh: jax.sharding.Mesh) -> None:
  """Raises unless the mesh's first axis lets the compiler place collectives."""
  axis = mesh.axis_names[0]
  if mesh.axis_types[0] != jax.sharding.AxisType.Auto:
    raise ValueError(f"mesh axis {axis!r} must be of type AxisType.Auto (the compiler "
                     "places the collectives), e.g. jax.make_mesh((n,), ('clients',), "
                     f"axis_types=(jax.sharding.AxisType.Auto,)); got {mesh.axis_types[0]}.")


def client_shardings(tree: Any, mesh: jax.sharding.Mesh, num_clients: int) -> Any:
  """The `NamedSharding` of each leaf of a run-stacked tree: axis 1 over the
  mesh's first axis.

  Leaves `(S, M, ...)` with `M = num_clients` are split over the devices of
  `mesh.axis_names[0]`; all other leaves (global models, class models,
  scalars per run) are replicated. A leaf whose second axis merely equals M
  by coincidence (K = M class models) is split too, which is correct, only
  laid out differently.
  """
  axis = mesh.axis_names[0]

  def spec(leaf):
    split = len(leaf.shape) >= 2 and leaf.shape[1] == num_clients
    return jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, axis) if split
        else jax.sharding.PartitionSpec())

  return jax.tree.map(spec, tree)


def place(tree: Any, shardings: Any) -> Any:
  """Host arrays as global arrays with the given shardings (also across hosts).

  Every process holds the same host copy (same data, same seeds) and
  contributes the shards of its own devices.
  """
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(put, tree, shardings)


def compiled(programs: engine.Programs, mesh: jax.sharding.Mesh, num_clients: int,
             values: chex.Array, feds: Any, counts: chex.Array, seeds: chex.Array
             ) -> engine.Programs:
  """The programs jitted so that the client axis stays split over the mesh."""
  carry = client_shardings(jax.eval_shape(programs.init, values, feds, counts, seeds),
                           mesh, num_clients)
  per_client = jax.ShapeDtypeStruct(counts.shape[:2], np.float32)
  metrics = client_shardings(engine.RoundMetrics(*[per_client] * 4), mesh, num_clients)
  return engine.Programs(initial=jax.jit(programs.initial, out_shardings=carry),
                         init=jax.jit(programs.init, out_shardings=carry),
                         round=jax.jit(programs.round, out_shardings=(carry, metrics)),
                         evaluate=jax.jit(programs.evaluate))


def to_host(x: chex.Array) -> np.ndarray:
  """A global array as a NumPy array on every process."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
