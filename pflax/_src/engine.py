"""The one simulation engine: a round of S runs of one algorithm as a few programs.

A run is an algorithm (`pflax.algorithms`, in its engine form `Groups`), a
seed and a federation. One round of one run is pure:

1. participants (`participants`) and faulty clients (`faulty_clients`) from
   the round's keys (`round_keys`);
2. each architecture group's participants train from their client models
   (`pflax.train`), each client with the key `fold_in(fold_in(train_key, g), i)`;
3. the faulty clients' uploads are corrupted (`fault_kind`: NaN, or their
   updates scaled; or their class counts were inflated at init); clients that
   did not take part, uploaded non-finite values or an update norm far above
   the round's median (`healthy_clients`) are given back their starting model
   and previous optimizer state (`drop_unhealthy`); the server step
   aggregates; a round without any healthy client keeps the state
   (`keep_if_nobody`).

Several runs (seeds, values of a swept hyperparameter) are that round mapped
over a leading run axis: with the client mapping "vmap" or "map" a round of all
runs is one program; with "loop" (the default on CPU, where vmapped clients
train slower than a loop) the clients of all runs are one client axis of the
threaded loop, between a run-vmapped program that gathers their inputs and one
that aggregates. A single run is a sweep of one. Every compiled program takes
the data as arguments, so runs of other seeds reuse it.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src import algorithm as alg
from pflax._src import groups as groups_lib
from pflax._src import mapping
from pflax._src import models as models_lib
from pflax._src import parts as parts_lib
from pflax._src import prng
from pflax._src import robust as robust_lib
from pflax._src import train as train_lib
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib
from pflax._src.data import federation as federation_lib

FAULT_STREAM = 0xFA17
"""`fold_in(participants_key, FAULT_STREAM)` draws a round's faulty clients."""

OUTLIER_FACTOR = 1000.0
"""Default `outlier_factor`: an update norm above 1000x the round's median is dropped."""

MIN_OUTLIER_CLIENTS = 3
"""The outlier test needs this many finite participants with a non-zero update."""

FAULT_KINDS = ("nan", "scaled", "inflated_counts")
"""`fault_kind`s: NaN uploads, updates times `fault_scale`, class counts times
`fault_scale` (a lie at registration)."""

DEFAULT_FAULT_SCALES = {"nan": 1.0, "scaled": 1e30, "inflated_counts": 10.0}
"""`fault_scale` of each kind when None."""


def run_keys(seed: int | chex.Array) -> chex.Array:
  """The keys `(init, warm-up, rounds)` of a run, all derived from its seed."""
  return jax.random.split(prng.key(seed), 3)


def round_keys(round_key: chex.PRNGKey, t: int | chex.Array) -> chex.Array:
  """The keys `(participants, training, server)` of round `t`."""
  return jax.random.split(jax.random.fold_in(round_key, t), 3)


def client_keys(key: chex.PRNGKey, ids: chex.Array) -> chex.Array:
  """The training keys `fold_in(key, i)` of the clients `ids` (of one group)."""
  return jax.vmap(jax.random.fold_in, (None, 0))(key, ids)


def num_participants(participation: float, num_clients: int) -> int:
  """`max(1, round(participation * M))` clients take part in a round."""
  return max(1, int(round(participation * num_clients)))


def participants(key: chex.PRNGKey, num_clients: int, participation: float) -> chex.Array:
  """A fixed number (`num_participants`) of distinct clients, sorted."""
  count = num_participants(participation, num_clients)
  return jnp.sort(jax.random.permutation(key, num_clients)[:count])


def num_faulty(fraction: float, participants_: int) -> int:
  """`round(fraction * P)`: how many of a round's `P` participants are faulty."""
  return int(round(fraction * participants_))


def faulty_clients(key: chex.PRNGKey, took_part: chex.Array, count: int) -> chex.Array:
  """Bool `(M,)`: `count` of the clients that took part.

  Client i gets the score `uniform(fold_in(key, i))` and the participants
  with the lowest scores are faulty, so the draw does not depend on padding
  or on how clients are grouped.
  """
  ids = jnp.arange(took_part.shape[0])
  score = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(ids)
  score = jnp.where(took_part, score, 2.0)
  rank = jnp.argsort(jnp.argsort(score))
  return took_part & (rank < count)


def upload_faults(trained: Any, faulty: chex.Array) -> Any:
  """The uploads with every entry of the faulty clients set to NaN."""
  def corrupt(x):
    return jnp.where(faulty.reshape((-1,) + (1,) * (x.ndim - 1)),
                     jnp.asarray(jnp.nan, x.dtype), x)
  return jax.tree.map(corrupt, trained)


def scale_updates(start: Any, trained: Any, faulty: chex.Array, scale: float) -> Any:
  """The uploads with the faulty clients' updates multiplied by `scale`:
  `start + scale (trained - start)`, computed in float32."""
  def corrupt(s, x):
    bad = (s.astype(jnp.float32)
           + scale * (x.astype(jnp.float32) - s.astype(jnp.float32))).astype(x.dtype)
    return jnp.where(faulty.reshape((-1,) + (1,) * (x.ndim - 1)), bad, x)
  return jax.tree.map(corrupt, start, trained)


def lying_clients(seed: chex.Array, num_real: int, padded: int,
                  fraction: float) -> chex.Array:
  """Bool `(padded,)`: the `round(fraction * M)` clients whose class counts are
  inflated for the whole run (`fault_kind` "inflated_counts"), drawn as
  `faulty_clients` from the run's init key."""
  real = jnp.arange(padded) < num_real
  key = jax.random.fold_in(run_keys(seed)[0], FAULT_STREAM)
  return faulty_clients(key, real, num_faulty(fraction, num_real))


def declared_counts(plan: "Plan", class_counts: chex.Array,
                    seed: chex.Array) -> chex.Array:
  """The `(M, K)` class counts the server is told: the lying clients' rows times
  `plan.scale` for `fault_kind` "inflated_counts", else `class_counts`."""
  if plan.fault_kind != "inflated_counts":
    return class_counts
  liars = lying_clients(seed, plan.num_clients, class_counts.shape[0],
                        plan.fault_fraction)
  return jnp.where(liars[:, None], class_counts * plan.scale, class_counts)


def update_outliers(log2_norms: chex.Array, candidates: chex.Array,
                    outlier_factor: float | None) -> chex.Array:
  """Bool `(M,)`: candidates whose update norm exceeds `outlier_factor` x the median.

  The median is over the candidates with a finite, non-zero norm, taken in
  log2 (for an even number, the geometric mean of the two middle norms).
  Fewer than `MIN_OUTLIER_CLIENTS` such candidates (nobody to outvote a liar),
  or an `outlier_factor` of None or 0, mark nobody.

  Args:
    log2_norms: `(M,)` `log2 ||upload_i - start_i||` (`pflax.aggregate.log2_update_norms`).
    candidates: bool `(M,)`, the finite participants.
    outlier_factor: the factor, > 1, or None.
  """
  if not outlier_factor:
    return jnp.zeros_like(candidates)
  ok = candidates & jnp.isfinite(log2_norms)
  k = jnp.sum(ok)
  ordered = jnp.sort(jnp.where(ok, log2_norms, jnp.inf))
  last = ordered.shape[0] - 1
  mid = 0.5 * (ordered[jnp.clip((k - 1) // 2, 0, last)]
               + ordered[jnp.clip(k // 2, 0, last)])
  return ok & (k >= MIN_OUTLIER_CLIENTS) & (log2_norms > mid + jnp.log2(outlier_factor))


def healthy_clients(took_part: chex.Array, finite: chex.Array, log2_norms: chex.Array,
                    outlier_factor: float | None = OUTLIER_FACTOR) -> chex.Array:
  """Bool `(M,)`: the participants whose upload the server aggregates.

  A participant is unhealthy when its upload is not finite or its update norm
  is an outlier of the round (`update_outliers`); the engine and a Flower
  server (`pflax._src.protocol.server_step`) both apply this rule.
  """
  ok = took_part & finite
  return ok & ~update_outliers(log2_norms, ok, outlier_factor)


def drop_unhealthy(start: Any, trained: Any, opt_before: Any, opt_after: Any,
                   healthy: chex.Array) -> tuple[Any, Any]:
  """`(trained, opt_state)` with the clients outside `healthy` treated as absent.

  A client that uploaded non-finite values (or did not take part) is given
  back the model it started the round from and its previous optimizer state,
  so the server update never reads its upload and no stored state, whatever
  the algorithm keeps, can become non-finite: the client is dropped from this
  round only.
  """
  return (weights_lib.keep_masked(trained, start, healthy),
          weights_lib.keep_masked(opt_after, opt_before, healthy))


def keep_if_nobody(healthy: chex.Array, new: Any, old: Any) -> Any:
  """`new`, or `old` unchanged when no client is healthy (an empty round).

  Aggregators given no weight return zeros (global models) under `jit`; a
  round in which every upload was dropped must leave the server state as it was.
  """
  anyone = jnp.any(healthy)
  return jax.tree.map(lambda a, b: jnp.where(anyone, a, b), new, old)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static structure of a sweep: everything its programs are compiled for.

  Attributes:
    build: `build(value) -> Groups`, the algorithm with the swept
      hyperparameter's value (ignored when nothing is swept).
    num_clients: M, the real clients (the federation may be padded beyond).
    participation: fraction of clients per round.
    fault_fraction: fraction of each round's participants that are faulty (of
      all clients, for "inflated_counts").
    fault_kind, fault_scale: what faulty clients do (`FAULT_KINDS`), and the
      factor of "scaled" and "inflated_counts" (None: `DEFAULT_FAULT_SCALES`).
    outlier_factor: the health rule's factor (`update_outliers`); None disables.
    local_epochs, batch_size: local training.
    strategy: the client mapping, resolved (`pflax.train.STRATEGIES`).
    output: selector of the models' output layer (`pflax.models.Parts`), whose
      norms every evaluation reports.
  """
  build: Callable[[Any], groups_lib.Groups]
  num_clients: int
  participation: float
  fault_fraction: float
  local_epochs: int
  batch_size: int
  strategy: str
  output: types.Selector = parts_lib.PFLAX_OUTPUT
  fault_kind: str = "nan"
  fault_scale: float | None = None
  outlier_factor: float | None = OUTLIER_FACTOR

  @property
  def scale(self) -> float:
    """The fault kind's factor."""
    return (DEFAULT_FAULT_SCALES[self.fault_kind] if self.fault_scale is None
            else self.fault_scale)


class RoundMetrics(NamedTuple):
  """Per-client outcome of one round, `(M,)` each: mean local loss,
  participation, health (aggregated), injected faults."""
  losses: chex.Array
  took_part: chex.Array
  healthy: chex.Array
  faulty: chex.Array


class ClientInputs(NamedTuple):
  """Arguments of a group's trainer for its training clients."""
  start: Any
  opt_state: Any
  context: Any
  x: chex.Array
  y: chex.Array
  valid: chex.Array
  keys: chex.Array


class _Inputs(NamedTuple):
  """One run's phase inputs: per group the clients' inputs and which train."""
  clients: tuple[ClientInputs, ...]
  chosen: tuple[chex.Array | None, ...]
  took_part: chex.Array
  faulty: chex.Array
  server_key: chex.PRNGKey


def _take(index: chex.Array | None, tree: Any) -> Any:
  """Rows `index` of every leaf (all rows, ungathered, for None)."""
  return tree if index is None else jax.tree.map(lambda x: x[index], tree)


def _put(index: chex.Array | None, full: Any, part: Any) -> Any:
  """`full` with rows `index` replaced by `part` (`part` itself for None)."""
  if index is None:
    return part
  return jax.tree.map(lambda f, p: f.at[index].set(p), full, part)


def _group_chosen(took_part: chex.Array, index: np.ndarray, count: int,
                  everyone: bool) -> chex.Array | None:
  """Positions in a group of its training clients: a static number of them.

  None (no gather: with the client axis sharded over devices, nothing moves
  between them) when every client takes part. Otherwise the group's
  participants come first, padded with other members of the group up to
  `min(count, m_g)` positions, whose results are dropped.
  """
  size = min(count, len(index))
  if everyone or size == len(index):
    return None
  rank = jnp.argsort(~took_part[index], stable=True)[:size]
  return jnp.sort(rank)


def _client_inputs(member: alg.Algorithm, start: Any, opt_state: Any, context: Any,
                   fed: federation_lib.Federation, chosen: chex.Array | None,
                   key: chex.PRNGKey) -> ClientInputs:
  """The training clients' starting models, optimizer states, data and keys.

  Client i (position i of its group) trains with the key `fold_in(key, i)`,
  whoever else takes part. The optimizer state is fresh unless the algorithm
  keeps it.
  """
  start = _take(chosen, start)
  opt_state = (_take(chosen, opt_state) if member.keep_opt_state
               else train_lib.init_opt_state(member.optimizer, start))
  x, y, valid = _take(chosen, (fed.x, fed.y, fed.valid))
  ids = jnp.arange(fed.x.shape[0]) if chosen is None else chosen
  return ClientInputs(start, opt_state, _take(chosen, context), x, y, valid,
                      client_keys(key, ids))


def _to_clients(parts: tuple[Any, ...], groups: groups_lib.Groups, m: int) -> chex.Array:
  """Per-group `(m_g,)` vectors as one `(M,)` vector in client order."""
  if len(parts) == 1:
    return parts[0]
  out = jnp.zeros((m,), parts[0].dtype)
  for part, index in zip(parts, groups.clients):
    out = out.at[index].set(part)
  return out


def _round_inputs(plan: Plan, groups: groups_lib.Groups, carry: Any,
                  feds: tuple[federation_lib.Federation, ...], seed: chex.Array,
                  t: chex.Array) -> _Inputs:
  """Round `t`'s participants, faulty clients and training inputs, for one run."""
  state, opt_states = carry
  sample_key, train_key, server_key = round_keys(run_keys(seed)[2], t)
  m = sum(f.x.shape[0] for f in feds)
  chosen = participants(jax.random.fold_in(sample_key, 0), plan.num_clients,
                        plan.participation)
  took_part = jnp.zeros(m, bool).at[chosen].set(True)
  count = num_faulty(plan.fault_fraction, chosen.shape[0])
  if plan.fault_kind == "inflated_counts":
    faulty = took_part & lying_clients(seed, plan.num_clients, m, plan.fault_fraction)
  elif count:
    faulty = faulty_clients(jax.random.fold_in(sample_key, FAULT_STREAM), took_part,
                            count)
  else:
    faulty = jnp.zeros_like(took_part)
  everyone = chosen.shape[0] == plan.num_clients
  group_chosen = tuple(_group_chosen(took_part, index, chosen.shape[0], everyone)
                       for index in groups.clients)
  starts = groups.client_models(state)
  contexts = groups.client_context(state)
  clients = tuple(
      _client_inputs(member, start, opt, context, fed, picked,
                     jax.random.fold_in(train_key, g))
      for g, (member, start, opt, context, fed, picked) in enumerate(zip(
          groups.members, starts, opt_states, contexts, feds, group_chosen)))
  return _Inputs(clients, group_chosen, took_part, faulty, server_key)


def _trained(groups: groups_lib.Groups, carry: Any, inputs: _Inputs,
             results: tuple[train_lib.ClientResult, ...]
             ) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], chex.Array]:
  """Results put back at their clients: `(starts, trained, opt_states, losses)`.

  Clients that did not train keep their starting models, optimizer states and
  a loss of 0.
  """
  state, opt_states = carry
  starts = groups.client_models(state)
  trained, opts, losses = [], [], []
  for member, start, opt, chosen, result in zip(groups.members, starts, opt_states,
                                                inputs.chosen, results):
    trained.append(_put(chosen, start, result.params))
    opts.append(_put(chosen, opt, result.opt_state) if member.keep_opt_state else opt)
    m_g = tree_lib.num_clients(start)
    losses.append(_put(chosen, jnp.zeros(m_g), result.loss))
  m = inputs.took_part.shape[0]
  return starts, tuple(trained), tuple(opts), _to_clients(tuple(losses), groups, m)


def _health(groups: groups_lib.Groups, took_part: chex.Array,
            starts: tuple[Any, ...], uploads: tuple[Any, ...],
            outlier_factor: float | None) -> chex.Array:
  """`healthy_clients` of all groups' uploads, `(M,)` in client order."""
  m = took_part.shape[0]
  finite = _to_clients(tuple(tree_lib.finite_clients(u) for u in uploads), groups, m)
  if not outlier_factor:
    return took_part & finite
  norms = _to_clients(tuple(robust_lib.log2_update_norms(u, s)
                            for s, u in zip(starts, uploads)), groups, m)
  return healthy_clients(took_part, finite, norms, outlier_factor)


def _round_outputs(groups: groups_lib.Groups, carry: Any, inputs: _Inputs,
                   results: tuple[train_lib.ClientResult, ...], *,
                   outlier_factor: float | None = OUTLIER_FACTOR,
                   fault_kind: str = "nan", fault_scale: float = 1.0
                   ) -> tuple[Any, RoundMetrics]:
  """The server step of one run after local training: new carry and metrics."""
  state, opt_before = carry
  starts, trained, opt_after, losses = _trained(groups, carry, inputs, results)
  if fault_kind == "nan":
    trained = tuple(upload_faults(u, inputs.faulty[index])
                    for index, u in zip(groups.clients, trained))
  elif fault_kind == "scaled":
    trained = tuple(scale_updates(s, u, inputs.faulty[index], fault_scale)
                    for index, s, u in zip(groups.clients, starts, trained))
  healthy = _health(groups, inputs.took_part, starts, trained, outlier_factor)
  kept, opts, masks = [], [], []
  for index, start, upload, before, after in zip(groups.clients, starts, trained,
                                                 opt_before, opt_after):
    mask = healthy[index]
    upload, opt = drop_unhealthy(start, upload, before, after, mask)
    kept.append(upload)
    opts.append(opt)
    masks.append(mask)
  losses = jnp.where(inputs.took_part, losses, 0.0)
  new = groups.server_update(state, tuple(kept), tuple(masks), inputs.server_key)
  state = keep_if_nobody(healthy, new, state)
  return (state, tuple(opts)), RoundMetrics(losses, inputs.took_part, healthy,
                                            inputs.faulty)


def _warmup_inputs(groups: groups_lib.Groups, carry: Any,
                   feds: tuple[federation_lib.Federation, ...], seed: chex.Array
                   ) -> _Inputs:
  """The warm-up: every client trains, with the run's warm-up key."""
  state, opt_states = carry
  key = run_keys(seed)[1]
  clients = tuple(
      _client_inputs(member, start, opt, context, fed, None, key)
      for member, start, opt, context, fed in zip(
          groups.members, groups.client_models(state), opt_states,
          groups.client_context(state), feds))
  m = sum(f.x.shape[0] for f in feds)
  everyone = jnp.ones(m, bool)
  return _Inputs(clients, (None,) * len(feds), everyone, ~everyone, key)


def _warmup_outputs(groups: groups_lib.Groups, carry: Any, inputs: _Inputs,
                    results: tuple[train_lib.ClientResult, ...], *,
                    outlier_factor: float | None = OUTLIER_FACTOR) -> Any:
  """The algorithm's warm-up update on the healthy uploads (`healthy_clients`);
  optimizer states kept."""
  state, opt_states = carry
  starts, trained, _, _ = _trained(groups, carry, inputs, results)
  healthy = _health(groups, inputs.took_part, starts, trained, outlier_factor)
  masks = tuple(healthy[index] for index in groups.clients)
  trained = tuple(weights_lib.keep_masked(t, s, m)
                  for t, s, m in zip(trained, starts, masks))
  return groups.warmup[1](state, trained, masks), opt_states


def _initial_carry(groups: groups_lib.Groups, feds: tuple[federation_lib.Federation, ...],
                   class_counts: chex.Array, seed: chex.Array) -> Any:
  """One run's initial state (every client from one model) and optimizer states."""
  key = run_keys(seed)[0]
  params = tuple(models_lib.init_stacked(model, key, fed.x[0, :1], fed.x.shape[0],
                                         same_init=True)
                 for model, fed in zip(groups.models, feds))
  state = groups.init(params, class_counts, key)
  opt_states = tuple(train_lib.init_opt_state(member.optimizer, start)
                     for member, start in zip(groups.members,
                                              groups.client_models(state)))
  return state, opt_states


def _merge_runs(tree: Any) -> Any:
  """Leaves `(S, C, ...)` -> `(S * C, ...)`: the runs' clients as one client axis."""
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def _split_runs(tree: Any, runs: int) -> Any:
  """Inverse of `_merge_runs`."""
  return jax.tree.map(lambda x: x.reshape(runs, -1, *x.shape[1:]), tree)


def _client_trainer(plan: Plan, epochs: int, g: int) -> Callable[..., Any]:
  """One client's local training in group `g`, a function of `(value, *client)`."""
  def train_one(value, *client):
    member = plan.build(value).members[g]
    return train_lib.train_client(member.loss, member.optimizer, *client,
                                  epochs=epochs, batch_size=plan.batch_size,
                                  unroll=member.unroll)
  return train_one


def _phase(plan: Plan, epochs: int, num_groups: int, pre: Callable[..., _Inputs],
           post: Callable[..., Any]) -> Callable[..., Any]:
  """A local-training phase of all runs: `pre`, the clients' training, `post`.

  `pre(groups, carry, feds, seed, *args)` and `post(groups, carry, inputs,
  results)` are per run. Returns `phase(values, carry, feds, seeds, *args)`
  over a leading run axis (`args` shared by the runs): one jitted program for
  "vmap" and "map"; for "loop" the clients of all runs trained by the threaded
  loop between two jitted programs.
  """
  trainers = [_client_trainer(plan, epochs, g) for g in range(num_groups)]
  per_run = lambda fn, extra: jax.vmap(fn, (0, 0, 0, 0) + (None,) * len(extra))

  if plan.strategy != "loop":
    def whole(value, carry, feds, seed, *args):
      groups = plan.build(value)
      inputs = pre(groups, carry, feds, seed, *args)
      results = tuple(mapping.map_clients(functools.partial(train, value),
                                          plan.strategy)(*clients)
                      for train, clients in zip(trainers, inputs.clients))
      return post(groups, carry, inputs, results)
    return jax.jit(lambda values, carry, feds, seeds, *args: per_run(whole, args)(
        values, carry, feds, seeds, *args))

  @jax.jit
  def before(values, carry, feds, seeds, *args):
    inputs = per_run(lambda value, *a: pre(plan.build(value), *a), args)(
        values, carry, feds, seeds, *args)
    clients = tuple(_merge_runs(c) for c in inputs.clients)
    client_values = tuple(jnp.repeat(values, c.x.shape[1]) for c in inputs.clients)
    return inputs._replace(clients=None), clients, client_values

  @jax.jit
  def after(values, carry, inputs, results):
    results = tuple(_split_runs(r, values.shape[0]) for r in results)
    return jax.vmap(lambda value, *a: post(plan.build(value), *a))(
        values, carry, inputs, results)

  loops = [mapping.map_clients(train, "loop") for train in trainers]

  def run_phase(values, carry, feds, seeds, *args):
    inputs, clients, client_values = before(values, carry, feds, seeds, *args)
    results = tuple(loop(v, *c) for loop, v, c in zip(loops, client_values, clients))
    return after(values, carry, inputs, results)
  return run_phase


class Programs(NamedTuple):
  """A sweep's compiled steps, each over the leading run axis of its arguments.

  `init(values, feds, class_counts, seeds) -> carry` (with the warm-up, if
  any; `initial` is the same before it, jitted); `round(values, carry,
  feds, seeds, t) -> (carry, RoundMetrics)`; `evaluate(values, carry, feds)
  -> ({kind: (S, M) correct test samples}, (S, M, K) output-layer norms)`.
  """
  initial: Callable[..., Any]
  init: Callable[..., Any]
  round: Callable[..., Any]
  evaluate: Callable[..., Any]


def _evaluator(plan: Plan, groups: groups_lib.Groups) -> Callable[..., Any]:
  """One run's evaluation: correct test samples per kind, output-layer norms."""
  strategy = "vmap" if plan.strategy == "loop" else plan.strategy
  counters = [mapping.map_clients(functools.partial(
      train_lib.evaluate_client, functools.partial(alg.logits, model)), strategy)
              for model in groups.models]

  def evaluate(value, carry, feds):
    built = plan.build(value)
    held = built.evaluate(carry[0])
    m = sum(f.x.shape[0] for f in feds)
    correct = {kind: _to_clients(tuple(
        count(h[kind], f.test_x, f.test_y, f.test_valid)
        for count, h, f in zip(counters, held, feds)), built, m)
               for kind in held[0]}
    norms = [output_norms(h["personalized"], plan.output) for h in held]
    if len(norms) == 1:
      return correct, norms[0]
    out = jnp.zeros((m, norms[0].shape[-1]), jnp.float32)
    for n, index in zip(norms, built.clients):
      out = out.at[index].set(n)
    return correct, out
  return evaluate


def output_norms(params: Any, where: types.Selector = parts_lib.PFLAX_OUTPUT
                 ) -> chex.Array:
  """`(M, K)` l2-norms of each client's output-layer weight vectors (cwFedAvg Fig. 3).

  Args:
    params: stacked models.
    where: selector of the output layer (`pflax.models.Parts.output`).
  """
  kernel = parts_lib.output_kernel(params, where).astype(jnp.float32)
  return jnp.sqrt(jnp.sum(jnp.square(kernel), axis=-2))


def programs(plan: Plan) -> Programs:
  """The jitted, run-mapped init, round and evaluation of a plan, once per plan.

  A plan whose model cannot be hashed (a Flax module with a list field, such
  as `nn.Sequential`) gets its programs built anew for each sweep.
  """
  try:
    hash(plan)
  except TypeError:
    return build_programs(plan)
  return cached_programs(plan)


def build_programs(plan: Plan) -> Programs:
  """`programs(plan)`, built without the cache."""
  groups = plan.build(None)
  num_groups = len(groups.members)
  def initial(value, feds, counts, seed):
    return _initial_carry(plan.build(value), feds, declared_counts(plan, counts, seed),
                          seed)

  starting = jax.jit(jax.vmap(initial))
  warm = (_phase(plan, groups.warmup[0], num_groups, _warmup_inputs,
                 functools.partial(_warmup_outputs, outlier_factor=plan.outlier_factor))
          if groups.warmup else None)

  def init(values, feds, class_counts, seeds):
    carry = starting(values, feds, class_counts, seeds)
    return carry if warm is None else warm(values, carry, feds, seeds)

  round_ = _phase(plan, plan.local_epochs, num_groups,
                  functools.partial(_round_inputs, plan),
                  functools.partial(_round_outputs, outlier_factor=plan.outlier_factor,
                                    fault_kind=plan.fault_kind, fault_scale=plan.scale))
  return Programs(initial=starting, init=init, round=round_,
                  evaluate=jax.jit(jax.vmap(_evaluator(plan, groups))))


cached_programs = functools.lru_cache(maxsize=32)(build_programs)
"""`build_programs` once per (hashable) plan."""
