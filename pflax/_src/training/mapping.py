"""How a per-client function is mapped over the stacked clients of a round.

All strategies compute the same result: `"vmap"` (one program over the client
axis; the path for accelerators), `"loop"` (a Python loop over clients of one
jitted per-client program, spread over one worker thread per CPU core; fastest
on XLA-CPU, where vmapped convolutions become slow grouped convolutions and
vmapped matmuls lose each client's weights from the cache) and `"map"`
(`lax.map` over chunks of vmapped clients, bounding memory; the chunk size can
come from a memory budget, see `chunk_size_for_budget`).
"""

import concurrent.futures
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STRATEGIES = ("auto", "vmap", "loop", "map")


def default_strategy() -> str:
  """"vmap" on accelerators, "loop" on CPU (measured faster there)."""
  return "loop" if jax.default_backend() == "cpu" else "vmap"


def resolve_strategy(strategy: str) -> str:
  """Validates a strategy name and resolves "auto"."""
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
  return default_strategy() if strategy == "auto" else strategy


def _leading(args: Any) -> int:
  return jax.tree.leaves(args)[0].shape[0]


def map_chunks(batched: Callable[..., Any], chunk_size: int, *args: Any) -> Any:
  """`lax.map` over chunks of `chunk_size` clients of a vmapped function.

  The `M // C` full chunks run in a `fori_loop` and the `M mod C` remaining
  clients in one vmap after it; every chunk is read with `dynamic_slice` and
  written in place into the stacked outputs. (`lax.map(..., batch_size=C)`
  instead copies the leading `C * (M // C)` clients of every input and
  concatenates the last chunk's outputs onto the others': two more stacked
  copies when C does not divide M.)
  """
  m = _leading(args)
  c = min(chunk_size, m)
  full = m // c * c
  take = lambda start, size: jax.tree.map(
      lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), args)
  put = lambda out, part, start: jax.tree.map(
      lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, start, 0), out, part)
  out = jax.tree.map(lambda s: jnp.zeros((m, *s.shape[1:]), s.dtype),
                     jax.eval_shape(batched, *take(0, c)))
  out = jax.lax.fori_loop(0, m // c, lambda i, o: put(o, batched(*take(i * c, c)), i * c),
                          out)
  if full < m:
    out = _put_row(out, batched(*take(full, m - full)), full)
  return out


def default_threads() -> int:
  """Worker threads of the "loop" strategy: the CPU cores this process may use."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def check_threads(threads: int | None) -> None:
  if threads is not None and threads < 1:
    raise ValueError(f"threads must be >= 1 or None, got {threads}.")


def _loop_clients(fn: Callable[..., Any], threads: int | None) -> Callable[..., Any]:
  """A Python loop of one jitted per-client program, over worker threads.

  Worker threads take the clients in turn, each running one client's program
  at a time; the calling thread writes every result in place into donated
  stacked outputs as the results arrive, in client order. A jitted call
  releases the GIL while it runs, so the workers train at the same time: on
  XLA-CPU one client's small matmuls and convolutions leave most cores idle,
  and 2 threads on 2 cores trained the MLP 1.5-1.9x and the CNN 1.3-1.5x
  faster than one. Every client runs the same program whatever the thread,
  so results do not depend on the number of threads.
  """

  outputs = {}  # one client's output shapes, by the arguments' signature

  def zeros(num_clients, signature, *args):
    if signature not in outputs:
      one_client = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                args)
      shapes = jax.eval_shape(fn, *one_client)
      outputs[signature] = (jax.tree.structure(shapes),
                            tuple((x.shape, x.dtype) for x in jax.tree.leaves(shapes)))
    return _stacked_zeros(num_clients, *outputs[signature])

  @jax.jit
  def one(i, *args):
    return fn(*jax.tree.map(lambda a: a[i], args))

  compiled = set()

  def loop(*args):
    m = _leading(args)
    workers = max(1, min(threads or default_threads(), m))
    signature = (jax.tree.structure(args),
                 tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))
    out = zeros(m, signature, *args)
    # Each worker waits for its client's program: `workers` programs run at once.
    wait = jax.block_until_ready if workers > 1 else lambda x: x
    train = lambda i: wait(one(np.int32(i), *args))
    first = 0
    if workers > 1 and signature not in compiled:  # compile once, not per worker
      out, first = _put_row(out, train(0), np.int32(0)), 1
      compiled.add(signature)
    for i, result in enumerate(_in_threads(train, range(first, m), workers), first):
      out = _put_row(out, result, np.int32(i))
    return out

  return loop


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _stacked_zeros(num_clients: int, structure: Any,
                   leaves: tuple[tuple[tuple[int, ...], Any], ...]) -> Any:
  """Zeros of `num_clients` stacked outputs of the given one-client leaves: one
  program per output structure, shared by every loop (and algorithm) producing it."""
  return jax.tree.unflatten(structure, [jnp.zeros((num_clients, *shape), dtype)
                                        for shape, dtype in leaves])


# Writing each result in place into donated stacked outputs saves a pass over
# fresh memory against stacking (MLP, M = 100: 420 -> 370 ms of CPU per round)
# or joining per-thread outputs (M = 1000: 51-62k -> 70k samples/s). Module
# level, so loops whose outputs have the same shapes share the program.
@functools.partial(jax.jit, donate_argnums=0)
def _put_row(out: Any, result: Any, i: Any) -> Any:
  """`out` with client `i`'s row of every leaf set to `result`'s."""
  return jax.tree.map(lambda o, r: jax.lax.dynamic_update_index_in_dim(o, r, i, 0),
                      out, result)


def _in_threads(fn: Callable[[int], Any], items: range, workers: int) -> Iterator[Any]:
  """`map(fn, items)` on `workers` threads (1: the calling thread), in order."""
  if workers == 1:
    yield from map(fn, items)
    return
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    yield from pool.map(fn, items)


def map_clients(fn: Callable[..., Any], strategy: str = "auto",
                chunk_size: int | None = None,
                threads: int | None = None) -> Callable[..., Any]:
  """Turns a per-client function into one over stacked arguments.

  Args:
    fn: a pure function of unstacked per-client arguments.
    strategy: "vmap", "loop", "map" or "auto" (see module docstring).
    chunk_size: clients per vmapped chunk for "map" (None: one client at a
      time); it need not divide the number of clients.
    threads: worker threads of the "loop" strategy (None: `default_threads()`,
      the CPU cores available; 1: a plain loop).

  Returns:
    A function of the same arguments with a leading client axis on every leaf,
    returning stacked outputs. Each strategy compiles once per input shape.
  """
  strategy = resolve_strategy(strategy)
  check_threads(threads)
  if strategy == "vmap":
    return jax.jit(jax.vmap(fn))
  if strategy == "map":
    # Jitted, the vmapped chunk is traced once for its output shapes and the loop.
    return jax.jit(functools.partial(map_chunks, jax.jit(jax.vmap(fn)),
                                     chunk_size or 1))
  return _loop_clients(fn, threads)


def bytes_per_client(fn: Callable[..., Any], *args: Any) -> int:
  """Bytes of memory one client of `fn` needs, from XLA's memory analysis.

  `fn` is compiled for one client's shapes (the leading axis of `args`
  dropped; nothing runs) and the estimate is

  .. math::
    b = \\text{arguments} + \\text{outputs} + \\text{temporaries}
        - \\text{aliased},

  what one client holds while it trains: its copy of the inputs, its outputs
  and the temporaries of the step (gradients, optimizer update, activations of
  one batch). It is conservative: for the MNIST CNN (SGD, 20 samples, batch
  10) it gives 8.4 MB, and the "map" program's temporaries for chunks of 500
  clients came to 5.8 MB per client (a chunk's inputs are read in place).

  Args:
    fn: a pure function of unstacked per-client arguments.
    *args: its arguments stacked over clients (arrays or `ShapeDtypeStruct` values).

  Returns:
    The estimate in bytes.
  """
  one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), args)
  stats = jax.jit(fn).lower(*one).compile().memory_analysis()
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def chunk_size_for_budget(bytes_per_client: int, num_clients: int,
                          memory_budget: int) -> int:
  """Clients per chunk so that the clients training at once fit a budget.

  With `b` bytes per client (see `bytes_per_client`), M clients and a budget
  `W`, at most `C_max = floor(W / b)` clients train at once; the round then
  needs `n = ceil(M / C_max)` chunks, and the smallest chunk size giving `n`
  chunks is returned:

  .. math::
    C = \\lceil M / n \\rceil, \\quad n = \\lceil M / \\lfloor W / b \\rfloor \\rceil.

  The budget covers the chunk's working memory, not the stacked inputs and
  outputs of all M clients, which the round holds whatever the chunk size.

  Example:
    >>> chunk_size_for_budget(100, num_clients=10, memory_budget=450)
    4
    >>> chunk_size_for_budget(100, num_clients=10, memory_budget=10**6)
    10

  Args:
    bytes_per_client: memory one training client needs (> 0).
    num_clients: M (> 0).
    memory_budget: bytes W for the clients training at once.

  Returns:
    The chunk size C, with `1 <= C <= M`.

  Raises:
    ValueError: if the budget cannot hold one client.
  """
  if bytes_per_client < 1 or num_clients < 1:
    raise ValueError("bytes_per_client and num_clients must be >= 1, got "
                     f"{bytes_per_client}, {num_clients}.")
  most = memory_budget // bytes_per_client
  if most < 1:
    raise ValueError(f"memory_budget of {memory_budget} bytes cannot hold one client, "
                     f"which needs {bytes_per_client} bytes.")
  chunks = -(-num_clients // most)
  return -(-num_clients // chunks)


def within_budget(fn: Callable[..., Any], strategy: str, memory_budget: int,
                   threads: int | None) -> Callable[..., Any]:
  """`map_clients` whose chunk size comes from `memory_budget` per input shapes.

  "vmap" is kept when all M clients fit the budget at once; "loop" (holding
  one client per worker thread at a time) is returned as is.
  """
  if strategy == "loop":
    return map_clients(fn, "loop", threads=threads)
  compiled = {}

  def run(*args):
    leaves, treedef = jax.tree.flatten(args)
    signature = (treedef, tuple((a.shape, a.dtype) for a in leaves))
    if signature not in compiled:
      m = _leading(args)
      chunk = chunk_size_for_budget(bytes_per_client(fn, *args), m, memory_budget)
      chosen = "vmap" if strategy == "vmap" and chunk == m else "map"
      compiled[signature] = map_clients(fn, chosen, chunk)
    return compiled[signature](*args)

  return run
