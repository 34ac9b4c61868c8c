"""The one simulation engine: a round of S runs of one algorithm as a few programs.

A run is an algorithm (`pflax.algorithms`, in its engine form `Groups`), a
seed and a federation. One round of one run is pure:

1. participants (`participants`) and faulty clients (`faulty_clients`) from
   the round's keys (`round_keys`);
2. each architecture group's participants train from their client models
   (`pflax.train`), each client with its key (`group_training_keys`);
3. the faulty clients' uploads are corrupted (`fault_kind`: NaN, their
   updates scaled, an attack of `attack_updates`; or their class counts were
   inflated at init); clients that
   did not take part, uploaded non-finite values or an update norm far above
   the round's median (`healthy_clients`) are given back their starting model
   and previous optimizer state; the server step (`server_step`) aggregates;
   a round without any healthy client keeps the state (`keep_if_nobody`).

A Flower federation (`pflax._src.simulation.protocol`) and the differentiable
run (`pflax._src.simulation.tune`) run the same round with these functions: the
initial state (`initial_state`, `initial_carry`), the key schedule
(`round_keys`, `round_participants`, `group_training_keys`,
`warmup_training_keys`), a client's local training (`client_trainer`) and the
server steps (`server_step`, `warmup_step`), for every architecture group.

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
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax._src.aggregators import privacy as privacy_lib
from pflax._src.aggregators import robust as robust_lib
from pflax._src.core import prng
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.data import federation as federation_lib
from pflax._src.methods import algorithm as alg
from pflax._src.simulation import groups as groups_lib
from pflax._src.training import mapping
from pflax._src.training import models as models_lib
from pflax._src.training import parts as parts_lib
from pflax._src.training import train as train_lib

FAULT_STREAM = 0xFA17
"""`fold_in(participants_key, FAULT_STREAM)` draws a round's faulty clients."""

OUTLIER_FACTOR = 1000.0
"""Default `outlier_factor`: an update norm above 1000x the round's median is dropped."""

MIN_OUTLIER_CLIENTS = 3
"""The outlier test needs this many finite participants with a non-zero update."""
MAX_LOSS = 1e6
"""The largest training loss a client may report; a larger one (or a non-finite
one) marks it unhealthy (`plausible_losses`): a mean cross-entropy of 1e6 is a
diverged model, not a measurement."""


def all_dropped(where: str, causes: str = "") -> str:
  """The one-line error of a round in which every participant was dropped;
  `where` names the round and the run ("round 3 of fedavg seed 0"), `causes`
  the setting's own causes of a drop besides the engine's health rule."""
  return (f"{where}: every participant was dropped ({causes}its upload not finite "
          "or an outlier, or its training loss not finite or beyond "
          f"{MAX_LOSS:g}): the training diverges; lower lr or set grad_clip "
          "(faulty_clients > 0 allows empty rounds).")


FAULT_KINDS = ("nan", "scaled", "inflated_counts", "sign_flip", "gaussian", "alie",
               "ipm")
"""`fault_kind`s: NaN uploads, updates times `fault_scale`, class counts times
`fault_scale` (a lie at registration), and the attacks of the Byzantine-robustness
literature (`attack_updates`): sign flipping, Gaussian noise, "a little is
enough" (ALIE) and inner-product manipulation (IPM)."""

DEFAULT_FAULT_SCALES = {"nan": 1.0, "scaled": 1e30, "inflated_counts": 10.0,
                        "sign_flip": 1.0, "gaussian": 1.0, "alie": 1.0, "ipm": 0.1}
"""`fault_scale` of each kind when None."""

PerGroup = tuple[types.Stacked, ...]
"""One `(m_g, ...)` stacked tree per architecture group (its clients' models)."""


def run_keys(seed: int | chex.Array) -> chex.Array:
  """The keys `(init, warm-up, rounds)` of a run, all derived from its seed."""
  return jax.random.split(prng.key(seed), 3)


def round_keys(round_key: chex.PRNGKey, t: int | chex.Array) -> chex.Array:
  """The keys `(participants, training, server)` of round `t`."""
  return jax.random.split(jax.random.fold_in(round_key, t), 3)


def client_keys(key: chex.PRNGKey, ids: chex.Array) -> chex.Array:
  """The training keys `fold_in(key, i)` of the clients `ids` (of one group)."""
  return jax.vmap(jax.random.fold_in, (None, 0))(key, ids)


def group_training_keys(train_key: chex.PRNGKey, g: int, ids: chex.Array) -> chex.Array:
  """A round's training keys of the clients at positions `ids` of group `g`:
  `fold_in(fold_in(train_key, g), i)`, whoever else takes part."""
  return client_keys(jax.random.fold_in(train_key, g), ids)


def warmup_training_keys(seed: int | chex.Array, ids: chex.Array) -> chex.Array:
  """The warm-up's training keys of the clients at positions `ids` of any group:
  `fold_in(warmup_key, i)` with the run's warm-up key (`run_keys`)."""
  return client_keys(run_keys(seed)[1], ids)


def num_participants(participation: float, num_clients: int) -> int:
  """`max(1, round(participation * M))` clients take part in a round."""
  return max(1, int(round(participation * num_clients)))


def participants(key: chex.PRNGKey, num_clients: int, participation: float) -> chex.Array:
  """A fixed number (`num_participants`) of distinct clients, sorted."""
  count = num_participants(participation, num_clients)
  return jnp.sort(jax.random.permutation(key, num_clients)[:count])


def round_participants(sample_key: chex.PRNGKey, num_clients: int,
                       participation: float) -> chex.Array:
  """A round's `participants`, drawn from `fold_in(sample_key, 0)` (`round_keys`)."""
  return participants(jax.random.fold_in(sample_key, 0), num_clients, participation)


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


def upload_faults(trained: types.Stacked, faulty: chex.Array) -> types.Stacked:
  """The uploads with every entry of the faulty clients set to NaN."""
  def corrupt(x):
    return jnp.where(faulty.reshape((-1,) + (1,) * (x.ndim - 1)),
                     jnp.asarray(jnp.nan, x.dtype), x)
  return jax.tree.map(corrupt, trained)


def scale_updates(start: types.Stacked, trained: types.Stacked, faulty: chex.Array,
                  scale: float) -> types.Stacked:
  """The uploads with the faulty clients' updates multiplied by `scale`:
  `start + scale (trained - start)`, computed in float32."""
  def corrupt(s, x):
    bad = (s.astype(jnp.float32)
           + scale * (x.astype(jnp.float32) - s.astype(jnp.float32))).astype(x.dtype)
    return jnp.where(faulty.reshape((-1,) + (1,) * (x.ndim - 1)), bad, x)
  return jax.tree.map(corrupt, start, trained)


def _benign_moments(updates: chex.Array, benign: chex.Array
                    ) -> tuple[chex.Array, chex.Array]:
  """The coordinate-wise mean and (population) standard deviation of the
  benign clients' rows of one `(m, ...)` float32 leaf (zeros without any)."""
  rows = benign.reshape((-1,) + (1,) * (updates.ndim - 1))
  count = jnp.maximum(jnp.sum(benign), 1).astype(jnp.float32)
  mean = jnp.sum(jnp.where(rows, updates, 0.0), axis=0) / count
  var = jnp.sum(jnp.where(rows, jnp.square(updates - mean), 0.0), axis=0) / count
  return mean, jnp.sqrt(var)


def alie_z(num_participants: chex.Array, num_faulty_: chex.Array) -> chex.Array:
  """Baruch et al. 2019's `z_max` (Algorithm 3): with `s = floor(n/2 + 1) - f`
  workers to win over, `z_max = Phi^-1((n - s) / n)`."""
  n = num_participants.astype(jnp.float32)
  s = jnp.floor(n / 2 + 1) - num_faulty_.astype(jnp.float32)
  return jax.scipy.special.ndtri(jnp.clip((n - s) / jnp.maximum(n, 1), 1e-6, 1 - 1e-6))


def attack_updates(kind: str, start: types.Stacked, trained: types.Stacked,
                   faulty: chex.Array, benign: chex.Array, key: chex.PRNGKey,
                   scale: float, z: chex.Array) -> types.Stacked:
  """The uploads with the faulty clients' replaced by an attack on their updates
  `u_i = trained_i - start_i` (float32), colluding where the attack says so:

  - "sign_flip": `start_i - scale u_i` (each its own update, reversed);
  - "gaussian": `start_i + N(0, scale^2)` per coordinate, drawn from `key`;
  - "alie": `start_i + mu - scale z sigma`, `mu`, `sigma` the benign clients'
    coordinate-wise mean and standard deviation and `z` Baruch et al.'s
    `z_max` (`alie_z`): the same upload for every colluder;
  - "ipm": `start_i - scale mu` (Xie et al. 2020, epsilon = `scale`): the
    same for every colluder.

  The other clients' uploads are returned exactly as given.
  """
  leaves, structure = jax.tree.flatten(trained)
  keys = jax.random.split(key, len(leaves))

  def one(s, x, k):
    s32 = s.astype(jnp.float32)
    u = x.astype(jnp.float32) - s32
    if kind == "sign_flip":
      bad = s32 - scale * u
    elif kind == "gaussian":
      bad = s32 + scale * jax.random.normal(k, x.shape, jnp.float32)
    else:
      mean, std = _benign_moments(u, benign)
      bad = s32 + (mean - scale * z * std if kind == "alie" else -scale * mean)[None]
    rows = faulty.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(rows, bad.astype(x.dtype), x)
  return jax.tree.unflatten(structure, [
      one(s, x, k) for s, x, k in zip(jax.tree.leaves(start), leaves, keys)])


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
  server (`pflax._src.simulation.protocol.server_step`) both apply this rule.
  """
  ok = took_part & finite
  return ok & ~update_outliers(log2_norms, ok, outlier_factor)


def plausible_losses(losses: chex.Array) -> chex.Array:
  """Bool `(M,)`: the clients whose reported training loss is finite and at most
  `MAX_LOSS` in magnitude; the others are unhealthy, like a non-finite upload,
  so that no 1e30 enters the round's loss."""
  return jnp.isfinite(losses) & (jnp.abs(losses) <= MAX_LOSS)


def keep_if_nobody(healthy: chex.Array, new: alg.State, old: alg.State) -> alg.State:
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
    poisson: client-level DP's sampling: each client takes part independently
      with probability `participation` (`pflax.privacy.poisson_sample`, from
      `fold_in(sample_key, 0)`), and every client trains (a static shape) while
      only the sampled ones are aggregated.
    local_epochs, batch_size: local training.
    strategy: the client mapping, resolved (`pflax.train.STRATEGIES`).
    output: selector of the models' output layer (`pflax.models.Parts`), whose
      norms every evaluation reports.
    precision: local training's compute precision (`pflax.train.with_precision`).
  """
  build: Callable[[chex.Numeric | None], groups_lib.Groups]
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
  precision: str = "float32"
  poisson: bool = False

  @property
  def scale(self) -> float:
    """The fault kind's factor."""
    return (DEFAULT_FAULT_SCALES[self.fault_kind] if self.fault_scale is None
            else self.fault_scale)


class Carry(NamedTuple):
  """What one run carries from a round to the next (a sweep's leaves add a
  leading run axis). A checkpoint stores it as the pair `(state, opt_states)`.

  Attributes:
    state: the algorithm's state (`initial_state`, `server_step`).
    opt_states: each group's `(m_g, ...)` stacked optimizer states of its
      clients, read where the group's algorithm keeps them (`keep_opt_state`).
  """
  state: alg.State
  opt_states: tuple[optax.OptState, ...]


class RoundMetrics(NamedTuple):
  """Per-client outcome of one round, `(M,)` each: mean local loss,
  participation, health (aggregated), injected faults."""
  losses: chex.Array
  took_part: chex.Array
  healthy: chex.Array
  faulty: chex.Array


class ClientInputs(NamedTuple):
  """Arguments of a group's trainer for its training clients."""
  start: types.Stacked
  opt_state: optax.OptState
  context: types.Stacked | None
  x: chex.Array
  y: chex.Array
  mask: chex.Array
  keys: chex.Array


class RoundInputs(NamedTuple):
  """One run's phase inputs (`round_inputs`): per group the clients' inputs and
  which train."""
  clients: tuple[ClientInputs, ...]
  chosen: tuple[chex.Array | None, ...]
  took_part: chex.Array
  faulty: chex.Array
  server_key: chex.PRNGKey


def _take(index: chex.Array | None, tree: types.Stacked) -> types.Stacked:
  """Rows `index` of every leaf (all rows, ungathered, for None)."""
  return tree if index is None else jax.tree.map(lambda x: x[index], tree)


def _put(index: chex.Array | None, full: types.Stacked,
         part: types.Stacked) -> types.Stacked:
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


def _client_inputs(start: types.Stacked, opt_state: optax.OptState,
                   context: types.Stacked | None, fed: federation_lib.Federation,
                   chosen: chex.Array | None,
                   keys: Callable[[chex.Array], chex.Array]) -> ClientInputs:
  """The training clients' starting models, stored optimizer states, data and keys.

  `keys(ids)` are the training keys of the clients at positions `ids` of the
  group (`group_training_keys`, `warmup_training_keys`).
  """
  x, y, mask = _take(chosen, (fed.x, fed.y, fed.mask))
  ids = jnp.arange(fed.x.shape[0]) if chosen is None else chosen
  return ClientInputs(_take(chosen, start), _take(chosen, opt_state),
                      _take(chosen, context), x, y, mask, keys(ids))


def in_client_order(groups: groups_lib.Groups,
                    parts: tuple[chex.Array, ...]) -> chex.Array:
  """Per-group `(m_g, ...)` arrays as one `(M, ...)` array in client order."""
  if len(parts) == 1:
    return parts[0]
  out = jnp.zeros((groups.num_clients, *parts[0].shape[1:]), parts[0].dtype)
  for part, index in zip(parts, groups.clients):
    out = out.at[index].set(part)
  return out


def _group_masks(groups: groups_lib.Groups, mask: chex.Array) -> tuple[chex.Array, ...]:
  """Each group's `(m_g,)` rows of an `(M,)` mask."""
  return tuple(mask[index] for index in groups.clients)


def round_inputs(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                 feds: tuple[federation_lib.Federation, ...], seed: chex.Array,
                 t: chex.Array) -> RoundInputs:
  """Round `t`'s participants, faulty clients and training inputs, for one run."""
  sample_key, train_key, server_key = round_keys(run_keys(seed)[2], t)
  m = sum(f.x.shape[0] for f in feds)
  if plan.poisson:
    chosen = jnp.arange(plan.num_clients)
    took_part = jnp.zeros(m, bool).at[:plan.num_clients].set(privacy_lib.poisson_sample(
        jax.random.fold_in(sample_key, 0), plan.num_clients, plan.participation))
  else:
    chosen = round_participants(sample_key, plan.num_clients, plan.participation)
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
  starts = groups.algorithm.client_models(carry.state)
  contexts = groups.algorithm.client_context(carry.state)
  clients = tuple(
      _client_inputs(start, opt, context, fed, picked,
                     functools.partial(group_training_keys, train_key, g))
      for g, (start, opt, context, fed, picked) in enumerate(zip(
          starts, carry.opt_states, contexts, feds, group_chosen)))
  return RoundInputs(clients, group_chosen, took_part, faulty, server_key)


def _trained(groups: groups_lib.Groups, carry: Carry, inputs: RoundInputs,
             results: tuple[train_lib.ClientResult, ...]
             ) -> tuple[PerGroup, PerGroup, tuple[optax.OptState, ...], chex.Array]:
  """Results put back at their clients: `(starts, trained, opt_states, losses)`.

  Clients that did not train keep their starting models, optimizer states and
  a loss of 0.
  """
  starts = groups.algorithm.client_models(carry.state)
  trained, opts, losses = [], [], []
  for member, start, opt, chosen, result in zip(groups.members, starts, carry.opt_states,
                                                inputs.chosen, results):
    trained.append(_put(chosen, start, result.params))
    opts.append(_put(chosen, opt, result.opt_state) if member.keep_opt_state else opt)
    m_g = tree_lib.num_clients(start)
    losses.append(_put(chosen, jnp.zeros(m_g), result.loss))
  return starts, tuple(trained), tuple(opts), in_client_order(groups, tuple(losses))


def _health(groups: groups_lib.Groups, took_part: chex.Array, starts: PerGroup,
            uploads: PerGroup, outlier_factor: float | None) -> chex.Array:
  """`healthy_clients` of all groups' uploads, `(M,)` in client order."""
  finite = in_client_order(groups, tuple(tree_lib.finite_clients(u) for u in uploads))
  if not outlier_factor:
    return took_part & finite
  norms = in_client_order(groups, tuple(robust_lib.log2_update_norms(u, s)
                                        for s, u in zip(starts, uploads)))
  return healthy_clients(took_part, finite, norms, outlier_factor)


def _healthy_uploads(groups: groups_lib.Groups, took_part: chex.Array, starts: PerGroup,
                     uploads: PerGroup, outlier_factor: float | None
                     ) -> tuple[chex.Array, PerGroup]:
  """`(healthy, uploads)`: the clients' health (`_health`) and the uploads with
  the unhealthy clients given back their starting models (so no update reads
  them)."""
  healthy = _health(groups, took_part, starts, uploads, outlier_factor)
  kept = tuple(weights_lib.keep_masked(u, s, mask)
               for u, s, mask in zip(uploads, starts, _group_masks(groups, healthy)))
  return healthy, kept


def server_step(groups: groups_lib.Groups, state: alg.State, starts: PerGroup,
                uploads: PerGroup, took_part: chex.Array, key: chex.PRNGKey,
                outlier_factor: float | None = OUTLIER_FACTOR
                ) -> tuple[alg.State, chex.Array]:
  """A round's aggregation of the uploads: `(state, healthy)`, healthy `(M,)`.

  The participants whose upload is unhealthy (`healthy_clients`) count as
  absent: the server update never reads their upload. A round without any
  healthy client keeps `state` (`keep_if_nobody`). The engine (after its fault
  injection) and a Flower server (`pflax._src.simulation.protocol.server_step`) both
  take this step.

  Args:
    groups: the algorithm.
    state: its state before the round.
    starts: per group, the clients' `(m_g, ...)` models at the round's start.
    uploads: per group, the clients' `(m_g, ...)` uploads (a client without
      one: its start).
    took_part: bool `(M,)`, the participants.
    key: the round's server key (`round_keys`).
    outlier_factor: the health rule's factor (`update_outliers`); None disables.
  """
  healthy, kept = _healthy_uploads(groups, took_part, starts, uploads, outlier_factor)
  new = groups.algorithm.server_update(state, kept, healthy, key)
  return keep_if_nobody(healthy, new, state), healthy


def warmup_step(groups: groups_lib.Groups, state: alg.State, starts: PerGroup,
                uploads: PerGroup, outlier_factor: float | None = OUTLIER_FACTOR
                ) -> alg.State:
  """The warm-up update (`Algorithm.warmup`) on every client's upload, the
  unhealthy ones dropped as in `server_step`."""
  healthy, kept = _healthy_uploads(groups, jnp.ones(groups.num_clients, bool), starts,
                                   uploads, outlier_factor)
  return groups.algorithm.warmup.update(state, kept, healthy)


def _with_faults(groups: groups_lib.Groups, starts: PerGroup, uploads: PerGroup,
                 faulty: chex.Array, took_part: chex.Array, key: chex.PRNGKey,
                 fault_kind: str, fault_scale: float) -> PerGroup:
  """The uploads with the faulty clients' corrupted ("nan", "scaled" and the
  attacks of `attack_updates`, each group's benign participants being the
  attacks' statistics; "inflated_counts" corrupts no upload)."""
  if fault_kind in ("sign_flip", "gaussian", "alie", "ipm"):
    z = alie_z(jnp.sum(took_part), jnp.sum(faulty))
    benign = took_part & ~faulty
    return tuple(attack_updates(fault_kind, s, u, faulty[index], benign[index],
                                jax.random.fold_in(key, g), fault_scale, z)
                 for g, (index, s, u) in enumerate(zip(groups.clients, starts, uploads)))
  if fault_kind == "nan":
    return tuple(upload_faults(u, faulty[index])
                 for index, u in zip(groups.clients, uploads))
  if fault_kind == "scaled":
    return tuple(scale_updates(s, u, faulty[index], fault_scale)
                 for index, s, u in zip(groups.clients, starts, uploads))
  return uploads


def round_outputs(groups: groups_lib.Groups, carry: Carry, inputs: RoundInputs,
                  results: tuple[train_lib.ClientResult, ...], *,
                  outlier_factor: float | None = OUTLIER_FACTOR,
                  fault_kind: str = "nan", fault_scale: float = 1.0
                  ) -> tuple[Carry, RoundMetrics]:
  """The server step of one run after local training: new carry and metrics.

  A client dropped by the `server_step` is given back its previous optimizer
  state too, so that no stored state, whatever the algorithm keeps, can become
  non-finite: it is dropped from this round only.
  """
  starts, trained, opt_after, losses = _trained(groups, carry, inputs, results)
  trained = _with_faults(groups, starts, trained, inputs.faulty, inputs.took_part,
                         jax.random.fold_in(inputs.server_key, FAULT_STREAM),
                         fault_kind, fault_scale)
  state, healthy = server_step(groups, carry.state, starts, trained,
                               inputs.took_part & plausible_losses(losses),
                               inputs.server_key, outlier_factor)
  opts = tuple(weights_lib.keep_masked(after, before, mask) for after, before, mask in
               zip(opt_after, carry.opt_states, _group_masks(groups, healthy)))
  losses = jnp.where(inputs.took_part, losses, 0.0)
  return Carry(state, opts), RoundMetrics(losses, inputs.took_part, healthy,
                                          inputs.faulty)


def _warmup_inputs(groups: groups_lib.Groups, carry: Carry,
                   feds: tuple[federation_lib.Federation, ...], seed: chex.Array
                   ) -> RoundInputs:
  """The warm-up: every client trains, with its warm-up key."""
  keys = functools.partial(warmup_training_keys, seed)
  clients = tuple(
      _client_inputs(start, opt, context, fed, None, keys)
      for start, opt, context, fed in zip(
          groups.algorithm.client_models(carry.state), carry.opt_states,
          groups.algorithm.client_context(carry.state), feds))
  everyone = jnp.ones(groups.num_clients, bool)
  return RoundInputs(clients, (None,) * len(feds), everyone, ~everyone,
                     run_keys(seed)[1])


def _warmup_outputs(groups: groups_lib.Groups, carry: Carry, inputs: RoundInputs,
                    results: tuple[train_lib.ClientResult, ...], *,
                    outlier_factor: float | None = OUTLIER_FACTOR) -> Carry:
  """The algorithm's `warmup_step`; optimizer states kept."""
  starts, trained, _, _ = _trained(groups, carry, inputs, results)
  return Carry(warmup_step(groups, carry.state, starts, trained, outlier_factor),
               carry.opt_states)


def cast_floating(tree: types.Tree, dtype: chex.ArrayDType | None) -> types.Tree:
  """The floating leaves of `tree` in `dtype` (None: `tree` unchanged)."""
  if dtype is None:
    return tree
  floating = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.floating)
  return jax.tree.map(lambda x: x.astype(dtype) if floating(x) else x, tree)


def initial_state(groups: groups_lib.Groups, sample_input: chex.Array,
                  class_counts: chex.Array, seed: int | chex.Array,
                  dtype: chex.ArrayDType | None = None) -> alg.State:
  """The algorithm's state before round 1: each group's clients start from one
  model of the group's architecture, drawn with the run's init key (`run_keys`).

  Args:
    groups: the algorithm.
    sample_input: one input batch `(1, ...)` (only its shape and dtype matter).
    class_counts: `(M, K)` training class counts, as declared (`declared_counts`).
    seed: the run's seed.
    dtype: None, or the float dtype of the initial models (`cast_floating`).
  """
  key = run_keys(seed)[0]
  params = tuple(cast_floating(models_lib.init_stacked(
      model, key, sample_input, len(index), same_init=True), dtype)
                 for model, index in zip(groups.models, groups.clients))
  return groups.algorithm.init(params, class_counts, key)


def initial_carry(groups: groups_lib.Groups, sample_input: chex.Array,
                  class_counts: chex.Array, seed: int | chex.Array,
                  dtype: chex.ArrayDType | None = None) -> Carry:
  """One run's `initial_state` and each client's fresh optimizer state."""
  state = initial_state(groups, sample_input, class_counts, seed, dtype)
  opt_states = tuple(train_lib.init_opt_state(member.optimizer, start)
                     for member, start in zip(groups.members,
                                              groups.algorithm.client_models(state)))
  return Carry(state, opt_states)


def start_opt_state(member: alg.Algorithm, params: types.Tree,
                    stored: optax.OptState | None) -> optax.OptState:
  """A client's optimizer state at the start of its local training: `stored`
  (its state after its last round) where `member` keeps it (`keep_opt_state`),
  else, or for None, a fresh one."""
  if stored is None or not member.keep_opt_state:
    return member.optimizer.init(params)
  return stored


def client_trainer(member: alg.Algorithm, epochs: int, batch_size: int, *,
                   remat: bool = False, precision: str = "float32"
                   ) -> Callable[..., train_lib.ClientResult]:
  """One client's local training in a group: `train(params, opt_state, context,
  x, y, mask, key) -> ClientResult`, unstacked.

  The client trains with its group's `member` (its `loss`, `optimizer` and
  `unroll`), from `start_opt_state(member, params, opt_state)`.

  Args:
    member: the group's algorithm (`Groups.members`).
    epochs, batch_size: local training.
    remat: checkpoint each local step (`pflax.train.train_client`), for
      reverse-mode differentiation through the training.
    precision: the loss's compute precision (`pflax.train.with_precision`).
  """
  loss = train_lib.with_precision(member.loss, precision)

  def train(params, opt_state, context, x, y, mask, key):
    return train_lib.train_client(
        loss, member.optimizer, params, start_opt_state(member, params, opt_state),
        context, x, y, mask, key, epochs=epochs, batch_size=batch_size,
        unroll=member.unroll, remat=remat)
  return train


def _merge_runs(tree: types.Tree) -> types.Tree:
  """Leaves `(S, C, ...)` -> `(S * C, ...)`: the runs' clients as one client axis."""
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def _split_runs(tree: types.Tree, runs: int) -> types.Tree:
  """Inverse of `_merge_runs`."""
  return jax.tree.map(lambda x: x.reshape(runs, -1, *x.shape[1:]), tree)


def _client_trainer(plan: Plan, epochs: int, g: int
                    ) -> Callable[..., train_lib.ClientResult]:
  """One client's local training in group `g`, a function of `(value, *client)`."""
  def train_one(value, *client):
    member = plan.build(value).members[g]
    return client_trainer(member, epochs, plan.batch_size,
                          precision=plan.precision)(*client)
  return train_one


def _phase(plan: Plan, epochs: int, num_groups: int, pre: Callable[..., RoundInputs],
           post: Callable[..., Carry | tuple[Carry, RoundMetrics]]
           ) -> Callable[..., Carry | tuple[Carry, RoundMetrics]]:
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

  `init(values, feds, class_counts, seeds) -> Carry` (with the warm-up, if
  any; `initial` is the same before it, jitted); `round(values, carry,
  feds, seeds, t) -> (Carry, RoundMetrics)`; `evaluate(values, carry, feds)
  -> ({kind: (S, M) correct test samples}, (S, M, K) output-layer norms)`.
  """
  initial: Callable[..., Carry]
  init: Callable[..., Carry]
  round: Callable[..., tuple[Carry, RoundMetrics]]
  evaluate: Callable[..., tuple[dict[str, chex.Array], chex.Array]]


def _evaluator(plan: Plan, groups: groups_lib.Groups
               ) -> Callable[..., tuple[dict[str, chex.Array], chex.Array]]:
  """One run's evaluation: correct test samples per kind, output-layer norms."""
  strategy = "vmap" if plan.strategy == "loop" else plan.strategy
  counters = [mapping.map_clients(functools.partial(
      train_lib.evaluate_client, functools.partial(alg.logits, model)), strategy)
              for model in groups.models]

  def evaluate(value, carry, feds):
    built = plan.build(value)
    held = built.algorithm.evaluate(carry.state)
    correct = {kind: in_client_order(built, tuple(
        count(h[kind], f.test_x, f.test_y, f.test_mask)
        for count, h, f in zip(counters, held, feds)))
               for kind in held[0]}
    return correct, client_output_norms(built, held, plan.output)
  return evaluate


def client_output_norms(groups: groups_lib.Groups,
                        held: tuple[dict[str, types.Stacked], ...],
                        where: types.Selector = parts_lib.PFLAX_OUTPUT) -> chex.Array:
  """`(M, K)` `output_norms` of every client's personalized model, from the
  evaluated models of each group (`Algorithm.evaluate`)."""
  return in_client_order(groups, tuple(output_norms(h["personalized"], where)
                                       for h in held))


def output_norms(params: types.Stacked, where: types.Selector = parts_lib.PFLAX_OUTPUT
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
    return initial_carry(plan.build(value), feds[0].x[0, :1],
                         declared_counts(plan, counts, seed), seed)

  starting = jax.jit(jax.vmap(initial))
  warmup = groups.algorithm.warmup
  warm = (_phase(plan, warmup.epochs, num_groups, _warmup_inputs,
                 functools.partial(_warmup_outputs, outlier_factor=plan.outlier_factor))
          if warmup else None)

  def init(values, feds, class_counts, seeds):
    carry = starting(values, feds, class_counts, seeds)
    return carry if warm is None else warm(values, carry, feds, seeds)

  round_ = _phase(plan, plan.local_epochs, num_groups,
                  functools.partial(round_inputs, plan),
                  functools.partial(round_outputs, outlier_factor=plan.outlier_factor,
                                    fault_kind=plan.fault_kind, fault_scale=plan.scale))
  return Programs(initial=starting, init=init, round=round_,
                  evaluate=jax.jit(jax.vmap(_evaluator(plan, groups))))


cached_programs = functools.lru_cache(maxsize=32)(build_programs)
"""`build_programs` once per (hashable) plan."""
