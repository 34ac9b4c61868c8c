"""Local training: per-client-loop semantics, strategies, compile-once."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import losses
from pflax import train
from pflax._src.training import mapping
from pflax._src.training import train as train_lib

M, L, D, K, B = 4, 13, 5, 3, 4


def _linear_loss(params, context, batch, key):
  """CE of a linear model plus a key-dependent term (checks key plumbing)."""
  logits = batch.x @ params["w"] + params["b"]
  noise = 1e-3 * jax.random.normal(key, ()) * jnp.sum(params["b"])
  return losses.cross_entropy(logits, batch.y, batch.mask) + noise + 0.0 * context


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  n = np.array([13, 7, 1, 4])  # one full client, partial batches, a single sample
  x = rng.normal(size=(M, L, D)).astype(np.float32)
  y = rng.integers(0, K, size=(M, L)).astype(np.int32)
  valid = np.arange(L)[None, :] < n[:, None]
  x[~valid] = 1e6  # padding is garbage: it must never reach a gradient
  params = {"w": jnp.asarray(rng.normal(size=(M, D, K)), jnp.float32),
            "b": jnp.zeros((M, K))}
  keys = jax.random.split(jax.random.PRNGKey(seed), M)
  return params, jnp.asarray(x), jnp.asarray(y), jnp.asarray(valid), n, keys


def _reference_client(optimizer, params, x, y, n, key, epochs):
  """Plain Python loop: each epoch, ceil(n/B) batches of the client's own samples."""
  order_key, step_key = jax.random.split(key)
  valid = jnp.arange(L) < n
  opt_state = optimizer.init(params)
  losses_ = []
  for e in range(epochs):
    order = np.asarray(train_lib._epoch_order(jax.random.fold_in(order_key, e), valid))[:n]
    for s in range(-(-n // B)):
      idx = order[s * B:(s + 1) * B]
      batch = train.Batch(x[idx], y[idx], jnp.ones(len(idx), bool))
      key_es = jax.random.fold_in(jax.random.fold_in(step_key, e), s)
      loss, grads = jax.value_and_grad(_linear_loss)(params, 0.0, batch, key_es)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      losses_.append(loss)
  return params, float(np.mean(losses_))


@pytest.mark.parametrize("strategy", [
    "vmap", "loop", "map", pytest.param("steps", marks=pytest.mark.slow)])
@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), optax.adam(0.05)],
                         ids=["sgd", "adam"])
def test_trainer_equals_per_client_loop(strategy, optimizer):
  params, x, y, valid, n, keys = _problem()
  trainer = train.make_trainer(_linear_loss, optimizer, epochs=2, batch_size=B,
                               strategy=strategy, chunk_size=2)
  opt_state = train.init_opt_state(optimizer, params)
  result = trainer(params, opt_state, jnp.zeros(M), x, y, valid, keys)
  for i in range(M):
    ref_params, ref_loss = _reference_client(
        optimizer, jax.tree.map(lambda a: a[i], params), x[i], y[i], int(n[i]),
        keys[i], epochs=2)
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[i], result.params),
                                ref_params, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.loss[i], ref_loss, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
def test_result_does_not_depend_on_padding(strategy):
  params, x, y, valid, _, keys = _problem(2)
  optimizer = optax.sgd(0.1)
  trainer = train.make_trainer(_linear_loss, optimizer, epochs=2, batch_size=B,
                               strategy=strategy)
  opt_state = train.init_opt_state(optimizer, params)
  pad = lambda a: jnp.pad(a, ((0, 0), (0, 2 * B + 1)) + ((0, 0),) * (a.ndim - 2))
  short = trainer(params, opt_state, jnp.zeros(M), x, y, valid, keys)
  long = trainer(params, opt_state, jnp.zeros(M), pad(x), pad(y), pad(valid), keys)
  chex.assert_trees_all_close(short, long, rtol=1e-6, atol=1e-6)


def test_steps_per_epoch_is_ceil_n_over_b():
  # With a constant-gradient loss and SGD, the parameter moves by lr per step.
  def count_loss(params, context, batch, key):
    del context, key
    return -params["c"] * jnp.any(batch.mask)

  params, x, y, valid, n, keys = _problem()
  trainer = train.make_trainer(count_loss, optax.sgd(1.0), epochs=3, batch_size=B,
                               strategy="vmap")
  start = {"c": jnp.zeros(M)}
  result = trainer(start, train.init_opt_state(optax.sgd(1.0), start), None, x, y,
                   valid, keys)
  np.testing.assert_array_equal(result.params["c"], 3 * np.ceil(n / B))


def _counting(loss_fn, traces):
  """`loss_fn`, appending to `traces` whenever it is traced (Python runs only then)."""
  def counted(*args):
    traces.append(1)
    return loss_fn(*args)
  return counted


def test_strategies_agree_and_compile_once():
  params, x, y, valid, n, keys = _problem(1)
  optimizer = optax.sgd(0.1, momentum=0.9)
  outs = []
  for strategy in ["vmap", "loop", "map"]:
    traces = []
    trainer = train.make_trainer(_counting(_linear_loss, traces), optimizer, epochs=1,
                                 batch_size=B, strategy=strategy)
    opt_state = train.init_opt_state(optimizer, params)
    for r in range(3):  # later rounds must reuse the compiled program
      result = trainer(params, opt_state, jnp.zeros(M), x, y, valid,
                       jax.random.split(jax.random.PRNGKey(r), M))
      if r == 0:
        first_round = len(traces)
    assert first_round > 0 and len(traces) == first_round, strategy
    outs.append(result)
  for other in outs[1:]:
    chex.assert_trees_all_close(outs[0].params, other.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [2, 3, 10])
def test_threaded_loop_equals_one_thread_exactly(threads):
  # M = 5 clients taken in turn by 2, 3 and 10 (more than M) worker threads.
  params, x, y, valid, _, keys = jax.tree.map(
      lambda a, b: jnp.concatenate([a, b[:1]]), _problem(5), _problem(6))
  optimizer = optax.sgd(0.1, momentum=0.9)
  args = (params, train.init_opt_state(optimizer, params), jnp.zeros(5), x, y, valid,
          keys)
  make = functools.partial(train.make_trainer, _linear_loss, optimizer, epochs=2,
                           batch_size=B, strategy="loop", unroll=1)
  expected = make(threads=1)(*args)
  threaded = make(threads=threads)
  for _ in range(2):  # the first call compiles on one thread, the second uses all
    chex.assert_trees_all_equal(threaded(*args), expected)


def test_threaded_loop_compiles_once():
  params, x, y, valid, _, keys = _problem(7)
  traces = []
  optimizer = optax.sgd(0.1)
  trainer = train.make_trainer(_counting(_linear_loss, traces), optimizer, epochs=1,
                               batch_size=B, strategy="loop", threads=2, unroll=1)
  opt_state = train.init_opt_state(optimizer, params)
  counts = []
  for r in range(3):
    trainer(params, opt_state, jnp.zeros(M), x, y, valid,
            jax.random.split(jax.random.PRNGKey(r), M))
    counts.append(len(traces))
  # Output shapes and the client program: traced once, not once per thread.
  assert counts == [2, 2, 2]


def _conv_loss(params, context, batch, key):
  del context, key
  kernel = params["w"].reshape(3, 3, 1, -1)
  out = jax.lax.conv_general_dilated(batch.x.reshape(-1, 4, 4, 1), kernel, (1, 1),
                                     "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return losses.cross_entropy(out.mean(axis=(1, 2)), batch.y, batch.mask)


def _scan_unrolls(loss_fn, params, unroll=None):
  """The `unroll` of every scan in one client's training program."""
  x = jnp.zeros((L, 16))
  jaxpr = jax.make_jaxpr(functools.partial(
      train.train_client, loss_fn, optax.sgd(0.1), epochs=2, batch_size=B,
      unroll=unroll))(params, optax.sgd(0.1).init(params), 0.0, x,
                      jnp.zeros(L, jnp.int32), jnp.ones(L, bool), jax.random.PRNGKey(0))
  return [e.params["unroll"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


def test_default_unroll_unrolls_only_convolutions_on_cpu():
  conv_params = {"w": jnp.ones((9 * K,))}
  dense_params = {"w": jnp.ones((16, K)), "b": jnp.zeros(K)}
  steps = 2 * -(-L // B)
  assert train_lib._has_convolution(_conv_loss, conv_params, None,
                               train.Batch(jnp.zeros((B, 16)), jnp.zeros(B, jnp.int32),
                                           jnp.ones(B, bool)), None)
  assert not train_lib._has_convolution(_linear_loss, dense_params, 0.0,
                                   train.Batch(jnp.zeros((B, 16)),
                                               jnp.zeros(B, jnp.int32),
                                               jnp.ones(B, bool)), jax.random.PRNGKey(0))
  assert _scan_unrolls(_conv_loss, conv_params) == [steps]  # fully unrolled on CPU
  assert _scan_unrolls(_linear_loss, dense_params) == [1]
  assert _scan_unrolls(_linear_loss, dense_params, unroll=3) == [3]


def test_default_threads_is_positive():
  assert train.default_threads() >= 1


def test_batch_schedule_puts_padding_last():
  valid = jnp.arange(10) < 6
  index, real = train.batch_schedule(jax.random.PRNGKey(0), valid, 2, 4)
  assert index.shape == (6, 4)
  assert real.sum() == 12
  for epoch in range(2):
    rows = np.asarray(index[3 * epoch:3 * epoch + 3]).ravel()[:6]
    assert sorted(rows.tolist()) == list(range(6))
  assert not real[2].any() and not real[5].any()


def test_evaluate_client_counts_only_valid():
  apply = lambda p, x: x @ p
  x = jnp.eye(3)[jnp.array([0, 1, 2, 0, 1])]
  y = jnp.array([0, 1, 1, 0, 2])
  valid = jnp.array([True, True, True, True, False])
  assert int(train.evaluate_client(apply, jnp.eye(3), x, y, valid, batch_size=2)) == 3


def test_bad_strategy_raises():
  with pytest.raises(ValueError, match="strategy"):
    train.make_trainer(_linear_loss, optax.sgd(0.1), epochs=1, batch_size=2,
                       strategy="threads")


@pytest.mark.parametrize("threads", [0, -1])
def test_bad_threads_raises(threads):
  with pytest.raises(ValueError, match="threads must be >= 1"):
    train.make_trainer(_linear_loss, optax.sgd(0.1), epochs=1, batch_size=2,
                       strategy="loop", threads=threads)


@pytest.fixture(scope="module")
def five_clients():
  """M = 5 clients (chunks of 2 leave one over), a trainer factory, vmap's result."""
  first, second = _problem(3), _problem(4)
  params, x, y, valid, _, keys = jax.tree.map(
      lambda a, b: jnp.concatenate([a, b[:1]]), first, second)
  optimizer = optax.sgd(0.1, momentum=0.9)
  args = (params, train.init_opt_state(optimizer, params), jnp.zeros(5), x, y, valid,
          keys)
  # A rolled scan (unroll=1) compiles fastest; chunking does not depend on it.
  one = functools.partial(train.train_client, _linear_loss, optimizer, epochs=2,
                          batch_size=B, unroll=1)
  make = functools.partial(train.make_trainer, _linear_loss, optimizer, epochs=2,
                           batch_size=B, unroll=1)
  return one, make, args, make(strategy="vmap")(*args)


def test_map_chunks_equal_vmap(five_clients):
  _, make, args, expected = five_clients
  result = make(strategy="map", chunk_size=3)(*args)  # chunks of 3 and 2
  chex.assert_trees_all_close(result, expected, rtol=1e-6, atol=1e-6)


def test_memory_budget_chunks_equal_vmap(five_clients, monkeypatch):
  one, make, args, expected = five_clients
  per_client = train.bytes_per_client(one, *args)
  budget = 2 * per_client + per_client // 2  # two clients at once: chunks 2, 2, 1
  assert train.chunk_size_for_budget(per_client, 5, budget) == 2
  monkeypatch.setattr(mapping, "default_strategy", lambda: "vmap")  # "auto" -> vmap
  for strategy, memory_budget in (("map", budget), ("auto", 10**12)):
    result = make(strategy=strategy, memory_budget=memory_budget)(*args)
    chex.assert_trees_all_close(result, expected, rtol=1e-6, atol=1e-6)


def test_chunk_size_for_budget():
  assert train.chunk_size_for_budget(100, 10, 10**12) == 10  # one chunk
  assert train.chunk_size_for_budget(100, 10, 1000) == 10
  assert train.chunk_size_for_budget(100, 10, 999) == 5  # two balanced chunks
  assert train.chunk_size_for_budget(100, 10, 450) == 4  # 4, 4, 2
  assert train.chunk_size_for_budget(100, 7, 300) == 3
  assert train.chunk_size_for_budget(100, 10, 100) == 1
  with pytest.raises(ValueError, match="memory_budget of 99 bytes"):
    train.chunk_size_for_budget(100, 10, 99)
  with pytest.raises(ValueError, match="bytes_per_client"):
    train.chunk_size_for_budget(0, 10, 99)


def test_memory_budget_errors(five_clients):
  _, make, args, _ = five_clients
  with pytest.raises(ValueError, match="memory_budget"):
    make(strategy="vmap", memory_budget=10**9)
  with pytest.raises(ValueError, match="memory_budget"):
    make(strategy="map", chunk_size=2, memory_budget=10**9)
  with pytest.raises(ValueError, match="memory_budget of 10 bytes"):
    make(strategy="map", memory_budget=10)(*args)


def _assert_trees_equal(actual, expected):
  """Bit for bit: same structure, shapes, dtypes and values."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer,chunk_size", [
    (optax.sgd(0.1, momentum=0.9), None),
    pytest.param(optax.adam(0.05), 3, marks=pytest.mark.slow)],
                         ids=["momentum", "adam-chunks"])
def test_steps_strategy_equals_vmap_exactly_and_compiles_once(optimizer, chunk_size):
  # Clients of 13, 7, 1 and 4 samples: partial and empty batches, empty steps
  # (the optimizer state must not move there), and chunks of 3 and 1 clients.
  # Equal to "vmap" bit for bit, it equals the per-client loop as "vmap" does.
  params, x, y, valid, _, keys = _problem(5)
  opt_state = train.init_opt_state(optimizer, params)
  args = (params, opt_state, jnp.arange(M, dtype=jnp.float32), x, y, valid)
  make = functools.partial(train.make_trainer, optimizer=optimizer, epochs=2,
                           batch_size=B)
  traces = []
  steps = make(_counting(_linear_loss, traces), strategy="steps", chunk_size=chunk_size)
  _assert_trees_equal(steps(*args, keys), make(_linear_loss, strategy="vmap")(*args, keys))
  first_round = len(traces)
  steps(*args, jax.random.split(jax.random.PRNGKey(9), M))  # a later round
  assert first_round > 0 and len(traces) == first_round


@pytest.mark.slow
def test_steps_strategy_equals_vmap_exactly_with_a_convolution():
  # A convolution: both programs are unrolled on CPU (`_scan_unroll`).
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(M, L, 16)), jnp.float32)
  y = jnp.asarray(rng.integers(0, K, size=(M, L)), jnp.int32)
  valid = jnp.arange(L)[None, :] < jnp.array([13, 7, 1, 4])[:, None]
  params = {"w": jnp.asarray(rng.normal(size=(M, 9 * K)), jnp.float32)}
  optimizer = optax.sgd(0.1)
  args = (params, train.init_opt_state(optimizer, params), None, x, y, valid,
          jax.random.split(jax.random.PRNGKey(6), M))
  make = functools.partial(train.make_trainer, _conv_loss, optimizer, epochs=2,
                           batch_size=B)
  _assert_trees_equal(make(strategy="steps")(*args), make(strategy="vmap")(*args))


def test_steps_strategy_refuses_a_budget():
  with pytest.raises(ValueError, match="memory_budget needs strategy"):
    train.make_trainer(_linear_loss, optax.sgd(0.1), epochs=1, batch_size=B,
                       strategy="steps", memory_budget=10**9)
