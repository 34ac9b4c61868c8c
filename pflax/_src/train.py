"""Local training of all clients of a round, with the semantics of a per-client loop.

Client i, in every local epoch, visits its own `n_i` samples in a fresh random
order in `ceil(n_i / B)` mini-batches (the last one smaller), one optimizer step
per batch, the loss averaged over the real samples of the batch. Clients are
padded to a common length L so that one compiled program serves them all: the
padded samples are ordered last, so they never enter a real batch, and steps
whose batch holds no real sample leave parameters and optimizer state untouched.

How clients are mapped is a strategy, all strategies computing the same result:
`"vmap"` (one program over the client axis; the path for accelerators),
`"loop"` (a Python loop over clients of one jitted per-client program, spread
over one worker thread per CPU core; fastest on XLA-CPU, where vmapped
convolutions become slow grouped convolutions and vmapped matmuls lose each
client's weights from the cache) and
`"map"` (`lax.map` over chunks of vmapped clients, bounding memory; the chunk
size can come from a memory budget, see `chunk_size_for_budget`).
"""

import concurrent.futures
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax._src import types

STRATEGIES = ("auto", "vmap", "loop", "map")


class Batch(NamedTuple):
  """One client's mini-batch: inputs, labels and a validity mask `(B,)`."""
  x: chex.Array
  y: chex.Array
  mask: chex.Array


LossFn = Callable[[types.Tree, Any, Batch, chex.PRNGKey], chex.Array]
"""`loss_fn(params, context, batch, key) -> scalar` for one client."""


def default_strategy() -> str:
  """"vmap" on accelerators, "loop" on CPU (measured faster there)."""
  return "loop" if jax.default_backend() == "cpu" else "vmap"


def resolve_strategy(strategy: str) -> str:
  """Validates a strategy name and resolves "auto"."""
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
  return default_strategy() if strategy == "auto" else strategy


def num_steps(length: int, batch_size: int) -> int:
  """Steps per epoch for the longest client: `ceil(L / B)`."""
  return -(-length // batch_size)


def epoch_order(key: chex.PRNGKey, valid: chex.Array) -> chex.Array:
  """A uniformly random order of the valid samples, followed by the padding.

  Sample j's sort key is the first word of `fold_in(key, j)` (one threefry
  hash per sample), so the order of a client's samples does not depend on how
  far its data are padded.
  """
  word = lambda j: jax.random.key_data(jax.random.fold_in(key, j))[0]
  bits = jax.vmap(word)(jnp.arange(valid.shape[0]))
  u = (bits >> 8).astype(jnp.float32) * 2.0**-24  # uniform on [0, 1), exact
  return jnp.argsort(jnp.where(valid, u, 2.0))


def batch_schedule(key: chex.PRNGKey, valid: chex.Array, epochs: int,
                   batch_size: int) -> tuple[chex.Array, chex.Array]:
  """Sample indices `(E * S, B)` and their validity for all local steps.

  Epoch e shuffles with `fold_in(key, e)`; padding ordered last only makes
  trailing steps of an epoch empty, so the real steps do not depend on the
  padded length.
  """
  length = valid.shape[0]
  steps = num_steps(length, batch_size)
  epoch_keys = jax.vmap(functools.partial(jax.random.fold_in, key))(jnp.arange(epochs))
  orders = jax.vmap(epoch_order, in_axes=(0, None))(epoch_keys, valid)
  pad = steps * batch_size - length
  orders = jnp.pad(orders, ((0, 0), (0, pad)))
  in_range = jnp.arange(steps * batch_size) < length
  index = orders.reshape(epochs * steps, batch_size)
  real = (valid[orders] & in_range).reshape(epochs * steps, batch_size)
  return index, real


def step_keys(key: chex.PRNGKey, epochs: int, steps: int) -> chex.Array:
  """Keys `(E * S,)` of the local steps: `fold_in(fold_in(key, e), s)`."""
  per_epoch = lambda e: jax.vmap(functools.partial(
      jax.random.fold_in, jax.random.fold_in(key, e)))(jnp.arange(steps))
  keys = jax.vmap(per_epoch)(jnp.arange(epochs))
  return keys.reshape(epochs * steps, *keys.shape[2:])


MAX_FULL_UNROLL = 64
"""Default `unroll`: convolutional schedules of at most this many steps are unrolled."""


def _primitives(jaxpr: Any) -> Iterator[str]:
  """Names of the primitives of a jaxpr, nested jaxprs (scan, jit, ...) included."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _primitives(inner)


def has_convolution(fn: Callable[..., Any], *args: Any) -> bool:
  """Whether `fn(*args)` computes a convolution.

  `fn` is traced on the shapes and dtypes of `args` (arrays, tracers or
  `jax.ShapeDtypeStruct`s; nothing runs) and its jaxpr, nested jaxprs
  included, is searched for `conv_general_dilated`. `make_trainer` uses it to
  decide whether unrolling the local steps pays on XLA-CPU.

  Example:
    >>> import jax.numpy as jnp
    >>> has_convolution(lambda x: x @ x.T, jnp.ones((2, 3)))
    False
  """
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                        args)
  return "conv_general_dilated" in _primitives(jax.make_jaxpr(fn)(*shapes).jaxpr)


def _scan_unroll(unroll: int | bool | None, steps: int,
                 convolutional: Callable[[], bool]) -> int | bool:
  """The `lax.scan` unroll for `steps` local steps.

  None: all steps (up to `MAX_FULL_UNROLL`) when the step holds a convolution
  and runs on XLA-CPU, else a rolled loop.
  """
  if unroll is None:
    return (steps <= MAX_FULL_UNROLL and jax.default_backend() == "cpu"
            and convolutional())
  return unroll if isinstance(unroll, bool) else max(1, min(unroll, steps))


class ClientResult(NamedTuple):
  """Output of one client's local training."""
  params: types.Tree
  opt_state: Any
  loss: chex.Array


def train_client(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                 params: types.Tree, opt_state: Any, context: Any,
                 x: chex.Array, y: chex.Array, valid: chex.Array,
                 key: chex.PRNGKey, *, epochs: int, batch_size: int,
                 unroll: int | bool | None = None) -> ClientResult:
  """Trains one client for `epochs` local epochs (unstacked inputs).

  Returns the trained parameters and optimizer state, and the mean training loss
  over the client's real steps. `unroll` is as in `make_trainer`.
  """
  order_key, step_key = jax.random.split(key)
  index, real = batch_schedule(order_key, valid, epochs, batch_size)
  keys = step_keys(step_key, epochs, num_steps(valid.shape[0], batch_size))
  grad_fn = jax.value_and_grad(loss_fn)

  def step(carry, inputs):
    params, opt_state = carry
    idx, mask, k = inputs
    loss, grads = grad_fn(params, context, Batch(x[idx], y[idx], mask), k)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    active = jnp.any(mask)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)
    return (keep(new_params, params), keep(new_opt_state, opt_state)), (
        jnp.where(active, loss, 0.0), active)

  first_batch = Batch(x[index[0]], y[index[0]], real[0])
  convolutional = lambda: has_convolution(grad_fn, params, context, first_batch, keys[0])
  (params, opt_state), (losses, active) = jax.lax.scan(
      step, (params, opt_state), (index, real, keys),
      unroll=_scan_unroll(unroll, index.shape[0], convolutional))
  mean_loss = jnp.sum(losses) / jnp.maximum(jnp.sum(active), 1)
  return ClientResult(params, opt_state, mean_loss)


def _leading(args: Any) -> int:
  return jax.tree.leaves(args)[0].shape[0]


def _map_chunks(batched: Callable[..., Any], chunk_size: int, *args: Any) -> Any:
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
    out = put(out, batched(*take(full, m - full)), full)
  return out


def default_threads() -> int:
  """Worker threads of the "loop" strategy: the CPU cores this process may use."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def _check_threads(threads: int | None) -> None:
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

  @functools.partial(jax.jit, static_argnums=0)
  def zeros(num_clients, *args):
    one_client = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), args)
    return jax.tree.map(lambda s: jnp.zeros((num_clients, *s.shape), s.dtype),
                        jax.eval_shape(fn, *one_client))

  @jax.jit
  def one(i, *args):
    return fn(*jax.tree.map(lambda a: a[i], args))

  # Writing each result in place into donated stacked outputs saves a pass
  # over fresh memory against stacking (MLP, M = 100: 420 -> 370 ms of CPU
  # per round) or joining per-thread outputs (M = 1000: 51-62k -> 70k
  # samples/s).
  @functools.partial(jax.jit, donate_argnums=0)
  def put(out, result, i):
    return jax.tree.map(lambda o, r: jax.lax.dynamic_update_index_in_dim(o, r, i, 0),
                        out, result)

  compiled = set()

  def loop(*args):
    m = _leading(args)
    workers = max(1, min(threads or default_threads(), m))
    out = zeros(m, *args)
    # Each worker waits for its client's program: `workers` programs run at once.
    wait = jax.block_until_ready if workers > 1 else lambda x: x
    train = lambda i: wait(one(np.int32(i), *args))
    signature = (jax.tree.structure(args),
                 tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))
    first = 0
    if workers > 1 and signature not in compiled:  # compile once, not per worker
      out, first = put(out, train(0), np.int32(0)), 1
      compiled.add(signature)
    for i, result in enumerate(_in_threads(train, range(first, m), workers), first):
      out = put(out, result, np.int32(i))
    return out

  return loop


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
  _check_threads(threads)
  if strategy == "vmap":
    return jax.jit(jax.vmap(fn))
  if strategy == "map":
    # Jitted, the vmapped chunk is traced once for its output shapes and the loop.
    return jax.jit(functools.partial(_map_chunks, jax.jit(jax.vmap(fn)),
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
    *args: its arguments stacked over clients (arrays or `ShapeDtypeStruct`s).

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


def _within_budget(fn: Callable[..., Any], strategy: str, memory_budget: int,
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


def make_trainer(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                 epochs: int, batch_size: int, strategy: str = "auto",
                 unroll: int | bool | None = None, chunk_size: int | None = None,
                 memory_budget: int | None = None,
                 threads: int | None = None) -> Callable[..., ClientResult]:
  """Builds the local-training function of a round; build once, call every round.

  Args:
    loss_fn: `loss_fn(params, context, batch, key) -> scalar` for one client.
    optimizer: an optax optimizer, one state per client.
    epochs: local epochs E.
    batch_size: mini-batch size B.
    strategy: how clients are mapped: "auto" (vmap on accelerators, loop on
      CPU), "vmap", "loop" or "map".
    unroll: `lax.scan` unroll factor over the E * S local steps; True
      unrolls all of them. None (default) unrolls all of them on XLA-CPU when
      E * S <= 64 and the step computes a convolution (`has_convolution`),
      and otherwise keeps a rolled loop. XLA-CPU canonicalises convolutions
      for its fast kernels only outside loops, so with any loop left in the
      schedule (even 8-fold unrolled) the backward convolutions of the FedAvg
      CNN take a generic path: 73 against 12.5 ms per step of 10 samples.
      Unrolling costs compile time, about 0.18 s per step, and speeds up only
      convolutions: the digits MLP's 35 steps compiled in 5.5 s unrolled and
      1.4 s rolled, and ran 51 against 32 ms per round of 20 clients.
    chunk_size: clients per chunk for the "map" strategy.
    memory_budget: bytes for the clients training at once, for strategies
      "map" and "auto" instead of `chunk_size`: at the first call with new
      shapes, one client's memory is measured (`bytes_per_client`, one extra
      compilation) and the chunk size taken from `chunk_size_for_budget`.
      "auto" keeps "vmap" while all clients fit the budget and chunks them
      otherwise; where it resolves to "loop" (CPU) one client per worker
      thread trains at a time and the budget is not consulted. None
      (default): no budget.
    threads: worker threads of the "loop" strategy (None: one per CPU core
      available, `default_threads()`).

  Returns:
    `train(params, opt_state, context, x, y, valid, keys) -> ClientResult`, all
    arguments stacked over clients (`keys`: `(M, ...)` PRNG keys). The result
    equals training each client alone with `train_client`.
  """
  if epochs < 1 or batch_size < 1:
    raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}.")
  _check_threads(threads)
  one = functools.partial(train_client, loss_fn, optimizer, epochs=epochs,
                          batch_size=batch_size, unroll=unroll)
  if memory_budget is None:
    return map_clients(one, strategy, chunk_size, threads)
  if strategy not in ("auto", "map") or chunk_size is not None:
    raise ValueError("memory_budget needs strategy 'auto' or 'map' and no chunk_size, "
                     f"got {strategy!r} and {chunk_size}.")
  return _within_budget(one, resolve_strategy(strategy), memory_budget, threads)


def init_opt_state(optimizer: optax.GradientTransformation,
                   params: types.Stacked) -> Any:
  """Stacked optimizer state: one per client."""
  return jax.vmap(optimizer.init)(params)


def evaluate_client(apply_fn: Callable[[types.Tree, chex.Array], chex.Array],
                    params: types.Tree, x: chex.Array, y: chex.Array,
                    valid: chex.Array, batch_size: int = 256) -> chex.Array:
  """Number of correctly classified valid samples of one client (int32).

  Batches of at most `batch_size` samples (fewer for a short test split, which
  is then not padded to a full batch).
  """
  length = x.shape[0]
  batch_size = max(1, min(batch_size, length))
  steps = num_steps(length, batch_size)
  pad = steps * batch_size - length
  xs = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(
      (steps, batch_size) + x.shape[1:])
  ys = jnp.pad(y, (0, pad)).reshape(steps, batch_size)
  vs = jnp.pad(valid, (0, pad)).reshape(steps, batch_size)

  def count(total, batch):
    bx, by, bv = batch
    hit = (jnp.argmax(apply_fn(params, bx), axis=-1) == by) & bv
    return total + jnp.sum(hit, dtype=jnp.int32), None

  return jax.lax.scan(count, jnp.zeros((), jnp.int32), (xs, ys, vs))[0]
