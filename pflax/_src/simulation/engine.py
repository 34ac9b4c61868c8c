"""The one simulation engine: a round of S runs of one algorithm as a few programs.

A run is an algorithm (`pflax.algorithms`, in its engine form `Groups`), a
seed and a federation. One round of one run is one pure function,
`round_step`, read top to bottom:

1. participants and faulty clients from the round's keys (`keys`: the key
   schedule; `faults`: faulty clients and the health rule), and each training
   client's inputs (`round_inputs`);
2. each architecture group's participants train from their client models
   (`pflax.train`), each client with its key (`keys.group_training_keys`);
3. the faulty clients' uploads are corrupted (`fault_kind`: NaN, their
   updates scaled, an attack of `faults.attack_updates`; or their class counts
   were inflated at init); clients that did not take part, uploaded non-finite
   values or an update norm far above the round's median
   (`faults.healthy_clients`) are given back their starting model and previous
   optimizer state; the server step (`server_step`) aggregates; a round without
   any healthy client keeps the state (`faults.keep_if_nobody`)
   (`round_outputs`).

An algorithm's warm-up is `warmup_round`, the same three steps. The
differentiable run (`pflax._src.simulation.tune`) calls `round_step` itself. A
Flower federation (`pflax._src.simulation.protocol`) runs the same round in
pieces, on other machines, with these functions: the initial state
(`initial_state`), the key schedule (`keys`), a client's local training
(`client_trainer`) and the server steps (`server_step`, `warmup_step`), for
every architecture group.

Several runs (seeds, values of a swept hyperparameter) are that round mapped
over a leading run axis (`_phase`): with the client mapping "vmap" or "map" a
round of all runs is `round_step` vmapped over runs, one program, whose local
training takes the clients of all runs on one client axis; with "loop"
(the default on CPU, where vmapped clients train slower than a loop) the
clients of all runs are one client axis of the threaded loop, between
`round_step`'s first step of all runs and its last step, each two programs:
the runs' draws (participants, faulty clients and keys: `round_draws`) and the
clients' inputs (`inputs_from_draws`); the uploads' checks (faults and health
rule: `checked_uploads`) and the server's update. The draws, the checks and
the initial models (`initial_models`) depend on the federation and the
models' shapes, not on the algorithm: their programs are shared by every
algorithm of a federation (`shared_draws`, `shared_checks`,
`shared_initial_models`), which compiles them once. A single run is a sweep
of one. Every compiled program takes the data as arguments, so runs of other
seeds reuse it.
"""
import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax._src.aggregators import privacy as privacy_lib
from pflax._src.aggregators import robust as robust_lib
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.data import federation as federation_lib
from pflax._src.methods import algorithm as alg
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import groups as groups_lib
from pflax._src.simulation import keys as keys_lib
from pflax._src.training import mapping
from pflax._src.training import models as models_lib
from pflax._src.training import parts as parts_lib
from pflax._src.training import train as train_lib


PerGroup = tuple[types.Stacked, ...]
"""One `(m_g, ...)` stacked tree per architecture group (its clients' models)."""


def declared_counts(plan: "Plan", class_counts: chex.Array,
                    seed: chex.Array) -> chex.Array:
  """The `(M, K)` class counts the server is told: the lying clients' rows times
  `plan.scale` for `fault_kind` "inflated_counts", else `class_counts`."""
  if plan.fault_kind != "inflated_counts":
    return class_counts
  liars = faults_lib.lying_clients(seed, plan.num_clients, class_counts.shape[0],
                                   plan.fault_fraction)
  return jnp.where(liars[:, None], class_counts * plan.scale, class_counts)


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
    outlier_factor: the health rule's factor (`faults.update_outliers`); None disables.
    poisson: client-level DP's sampling: each client takes part independently
      with probability `participation` (`pflax.privacy.poisson_sample`, from
      `fold_in(sample_key, 0)`), and every client trains (a static shape) while
      only the sampled ones are aggregated.
    local_epochs, batch_size: local training.
    strategy: the client mapping, resolved (`pflax.train.STRATEGIES`).
    output: selector of the models' output layer (`pflax.models.Parts`), whose
      norms every evaluation reports.
    precision: local training's compute precision (`pflax.train.with_precision`).
    merge_runs: whether a sweep's round with the client mapping "vmap" or
      "map" trains the clients of all its runs on one client axis
      (`_runs_on_one_axis`), or each run's on its own (False: on a mesh,
      where the client axis is split over the devices, `pflax.simulate`).
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
  outlier_factor: float | None = faults_lib.OUTLIER_FACTOR
  precision: str = "float32"
  poisson: bool = False
  merge_runs: bool = True

  @property
  def scale(self) -> float:
    """The fault kind's factor."""
    return (faults_lib.DEFAULT_FAULT_SCALES[self.fault_kind]
            if self.fault_scale is None else self.fault_scale)


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
                   chosen: chex.Array | None, keys: chex.Array) -> ClientInputs:
  """The training clients' starting models, stored optimizer states, data and
  training keys (`keys`, one per training client)."""
  x, y, mask = _take(chosen, (fed.x, fed.y, fed.mask))
  return ClientInputs(_take(chosen, start), _take(chosen, opt_state),
                      _take(chosen, context), x, y, mask, keys)


def in_client_order(groups: "groups_lib.Groups | Layout",
                    parts: tuple[chex.Array, ...]) -> chex.Array:
  """Per-group `(m_g, ...)` arrays as one `(M, ...)` array in client order."""
  if len(parts) == 1:
    return parts[0]
  out = jnp.zeros((groups.num_clients, *parts[0].shape[1:]), parts[0].dtype)
  for part, index in zip(parts, groups.clients):
    out = out.at[index].set(part)
  return out


def _group_masks(groups: "groups_lib.Groups | Layout", mask: chex.Array
                 ) -> tuple[chex.Array, ...]:
  """Each group's `(m_g,)` rows of an `(M,)` mask."""
  return tuple(mask[index] for index in groups.clients)


class Draws(NamedTuple):
  """A round's random choices (`round_draws`, `warmup_draws`): functions of the
  run's seed, the round and the federation's `Schedule` only, so every
  algorithm of a federation draws the same ones.

  Attributes:
    took_part: bool `(M,)`, the participants.
    faulty: bool `(M,)`, the participants whose upload is corrupted.
    chosen: per group, the positions of its training clients (None: all).
    keys: per group, the training keys of those clients.
    server_key: the round's server key.
  """
  took_part: chex.Array
  faulty: chex.Array
  chosen: tuple[chex.Array | None, ...]
  keys: tuple[chex.Array, ...]
  server_key: chex.PRNGKey


class Layout(NamedTuple):
  """M clients in round robin over architecture groups, as `Groups` places them
  (`Groups.clients`), without the algorithm: hashable.

  Attributes:
    num_clients: M, all groups' clients.
    num_groups: the architecture groups.
  """
  num_clients: int
  num_groups: int

  @property
  def clients(self) -> tuple[np.ndarray, ...]:
    """Each group's client indices (`Groups.clients`)."""
    return alg.round_robin(self.num_clients, self.num_groups)


def layout(groups: groups_lib.Groups) -> Layout:
  """The `Layout` of `groups`' clients."""
  return Layout(groups.num_clients, len(groups.models))


class Schedule(NamedTuple):
  """What a run's draws depend on besides its seed and the round (hashable).

  Attributes:
    num_clients: the real clients (`Plan.num_clients`).
    layout: all clients of the federation, padding included, in their
      architecture groups (`Groups.num_clients`, `Groups.clients`).
    participation, fault_fraction, fault_kind, poisson: as in `Plan`.
  """
  num_clients: int
  layout: Layout
  participation: float
  fault_fraction: float
  fault_kind: str
  poisson: bool


def schedule(plan: "Plan", groups: groups_lib.Groups) -> Schedule:
  """The `Schedule` of a plan's runs of `groups`."""
  return Schedule(plan.num_clients, layout(groups), plan.participation,
                  plan.fault_fraction, plan.fault_kind, plan.poisson)


def round_draws(schedule: Schedule, seed: chex.Array, t: chex.Array) -> Draws:
  """Round `t`'s participants, faulty clients and training keys, for one run."""
  sample_key, train_key, server_key = keys_lib.round_keys(keys_lib.run_keys(seed)[2], t)
  m = schedule.layout.num_clients
  if schedule.poisson:
    chosen = jnp.arange(schedule.num_clients)
    took_part = jnp.zeros(m, bool).at[:schedule.num_clients].set(
        privacy_lib.poisson_sample(jax.random.fold_in(sample_key, 0),
                                   schedule.num_clients, schedule.participation))
  else:
    chosen = keys_lib.round_participants(sample_key, schedule.num_clients,
                                         schedule.participation)
    took_part = jnp.zeros(m, bool).at[chosen].set(True)
  count = faults_lib.num_faulty(schedule.fault_fraction, chosen.shape[0])
  if schedule.fault_kind == "inflated_counts":
    faulty = took_part & faults_lib.lying_clients(seed, schedule.num_clients, m,
                                                  schedule.fault_fraction)
  elif count:
    faulty = faults_lib.faulty_clients(
        jax.random.fold_in(sample_key, faults_lib.FAULT_STREAM), took_part, count)
  else:
    faulty = jnp.zeros_like(took_part)
  everyone = chosen.shape[0] == schedule.num_clients
  clients = schedule.layout.clients
  group_chosen = tuple(_group_chosen(took_part, index, chosen.shape[0], everyone)
                       for index in clients)
  keys = tuple(keys_lib.group_training_keys(
      train_key, g, jnp.arange(len(index)) if picked is None else picked)
               for g, (index, picked) in enumerate(zip(clients, group_chosen)))
  return Draws(took_part, faulty, group_chosen, keys, server_key)


def warmup_draws(schedule: Schedule, seed: chex.Array) -> Draws:
  """The warm-up's draws: every client trains, with its warm-up key."""
  everyone = jnp.ones(schedule.layout.num_clients, bool)
  keys = tuple(keys_lib.warmup_training_keys(seed, jnp.arange(len(index)))
               for index in schedule.layout.clients)
  return Draws(everyone, ~everyone, (None,) * schedule.layout.num_groups, keys,
               keys_lib.run_keys(seed)[1])


def inputs_from_draws(groups: groups_lib.Groups, carry: Carry,
                      feds: tuple[federation_lib.Federation, ...], draws: Draws
                      ) -> RoundInputs:
  """A round's training inputs, per group, from its `Draws`."""
  clients = tuple(
      _client_inputs(start, opt, context, fed, picked, keys)
      for start, opt, context, fed, picked, keys in zip(
          groups.algorithm.client_models(carry.state), carry.opt_states,
          groups.algorithm.client_context(carry.state), feds, draws.chosen, draws.keys))
  return RoundInputs(clients, draws.chosen, draws.took_part, draws.faulty,
                     draws.server_key)


def round_inputs(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                 feds: tuple[federation_lib.Federation, ...], seed: chex.Array,
                 t: chex.Array) -> RoundInputs:
  """Round `t`'s participants, faulty clients and training inputs, for one run."""
  return inputs_from_draws(groups, carry, feds,
                           round_draws(schedule(plan, groups), seed, t))


def _placed(groups: "groups_lib.Groups | Layout", starts: PerGroup,
            chosen: tuple[chex.Array | None, ...], params: PerGroup,
            losses: tuple[chex.Array, ...]) -> tuple[PerGroup, chex.Array]:
  """The training clients' models and mean losses put back at their rows:
  `(trained, losses)`, per group `(m_g, ...)` models (the others' starts) and
  `(M,)` losses in client order (0 for the others)."""
  trained = tuple(_put(c, start, p) for start, c, p in zip(starts, chosen, params))
  zeros = lambda start: jnp.zeros(tree_lib.num_clients(start))
  return trained, in_client_order(groups, tuple(
      _put(c, zeros(start), loss) for start, c, loss in zip(starts, chosen, losses)))


def _stored_opt_states(groups: groups_lib.Groups, opt_states: tuple[optax.OptState, ...],
                       chosen: tuple[chex.Array | None, ...],
                       results: tuple[train_lib.ClientResult, ...]
                       ) -> tuple[optax.OptState, ...]:
  """Each group's optimizer states after training: the training clients' new
  ones where the group's algorithm keeps them (`keep_opt_state`), else, and
  for the other clients, `opt_states`."""
  return tuple(_put(c, opt, result.opt_state) if member.keep_opt_state else opt
               for member, opt, c, result in zip(groups.members, opt_states, chosen,
                                                 results))


def _health(groups: "groups_lib.Groups | Layout", took_part: chex.Array,
            starts: PerGroup, uploads: PerGroup, outlier_factor: float | None
            ) -> chex.Array:
  """`faults.healthy_clients` of all groups' uploads, `(M,)` in client order."""
  finite = in_client_order(groups, tuple(tree_lib.finite_clients(u) for u in uploads))
  if not outlier_factor:
    return took_part & finite
  norms = in_client_order(groups, tuple(robust_lib.log2_update_norms(u, s)
                                        for s, u in zip(starts, uploads)))
  return faults_lib.healthy_clients(took_part, finite, norms, outlier_factor)


def _healthy_uploads(groups: "groups_lib.Groups | Layout", took_part: chex.Array,
                     starts: PerGroup, uploads: PerGroup, outlier_factor: float | None
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
                outlier_factor: float | None = faults_lib.OUTLIER_FACTOR
                ) -> tuple[alg.State, chex.Array]:
  """A round's aggregation of the uploads: `(state, healthy)`, healthy `(M,)`.

  The participants whose upload is unhealthy (`faults.healthy_clients`) count as
  absent: the server update never reads their upload. A round without any
  healthy client keeps `state` (`faults.keep_if_nobody`). The engine (after its fault
  injection) and a Flower server (`pflax._src.simulation.protocol.server_step`) both
  take this step.

  Args:
    groups: the algorithm.
    state: its state before the round.
    starts: per group, the clients' `(m_g, ...)` models at the round's start.
    uploads: per group, the clients' `(m_g, ...)` uploads (a client without
      one: its start).
    took_part: bool `(M,)`, the participants.
    key: the round's server key (`keys.round_keys`).
    outlier_factor: the health rule's factor (`faults.update_outliers`); None disables.
  """
  healthy, kept = _healthy_uploads(groups, took_part, starts, uploads, outlier_factor)
  return _aggregate(groups, state, kept, healthy, key), healthy


def _aggregate(groups: groups_lib.Groups, state: alg.State, uploads: PerGroup,
               healthy: chex.Array, key: chex.PRNGKey) -> alg.State:
  """The algorithm's server update of the healthy clients' uploads; `state`
  for a round without any (`faults.keep_if_nobody`)."""
  new = groups.algorithm.server_update(state, uploads, healthy, key)
  return faults_lib.keep_if_nobody(healthy, new, state)


def warmup_step(groups: groups_lib.Groups, state: alg.State, starts: PerGroup,
                uploads: PerGroup,
                outlier_factor: float | None = faults_lib.OUTLIER_FACTOR
                ) -> alg.State:
  """The warm-up update (`Algorithm.warmup`) on every client's upload, the
  unhealthy ones dropped as in `server_step`."""
  healthy, kept = _healthy_uploads(groups, jnp.ones(groups.num_clients, bool), starts,
                                   uploads, outlier_factor)
  return groups.algorithm.warmup.update(state, kept, healthy)


def _with_faults(groups: "groups_lib.Groups | Layout", starts: PerGroup,
                 uploads: PerGroup, faulty: chex.Array, took_part: chex.Array,
                 key: chex.PRNGKey, fault_kind: str, fault_scale: float) -> PerGroup:
  """The uploads with the faulty clients' corrupted ("nan", "scaled" and the
  attacks of `faults.attack_updates`, each group's benign participants being the
  attacks' statistics; "inflated_counts" corrupts no upload)."""
  if fault_kind in ("sign_flip", "gaussian", "alie", "ipm"):
    z = faults_lib.alie_z(jnp.sum(took_part), jnp.sum(faulty))
    benign = took_part & ~faulty
    return tuple(faults_lib.attack_updates(fault_kind, s, u, faulty[index],
                                           benign[index], jax.random.fold_in(key, g),
                                           fault_scale, z)
                 for g, (index, s, u) in enumerate(zip(groups.clients, starts, uploads)))
  if fault_kind == "nan":
    return tuple(faults_lib.upload_faults(u, faulty[index])
                 for index, u in zip(groups.clients, uploads))
  if fault_kind == "scaled":
    return tuple(faults_lib.scale_updates(s, u, faulty[index], fault_scale)
                 for index, s, u in zip(groups.clients, starts, uploads))
  return uploads


class UploadRule(NamedTuple):
  """What the checks of a round's uploads depend on (`checked_uploads`): the
  clients' layout, the fault injection and the health rule. Hashable.

  Attributes:
    layout: the clients' architecture groups.
    fault_kind, fault_scale: what faulty clients do (`Plan.fault_kind`, `Plan.scale`).
    outlier_factor: the health rule's factor (`faults.update_outliers`); None disables.
    warmup: the warm-up's checks (every client takes part; no fault is
      injected, no loss checked).
  """
  layout: Layout
  fault_kind: str
  fault_scale: float
  outlier_factor: float | None
  warmup: bool = False


def upload_rule(plan: Plan, groups: groups_lib.Groups, warmup: bool = False
                ) -> UploadRule:
  """The `UploadRule` of a plan's runs of `groups` (of its warm-up with `warmup`)."""
  return UploadRule(layout(groups), plan.fault_kind, plan.scale, plan.outlier_factor,
                    warmup)


class Checked(NamedTuple):
  """A round's uploads after their checks (`checked_uploads`).

  Attributes:
    uploads: per group, the `(m_g, ...)` uploads, an unhealthy client's
      replaced by its start.
    healthy: bool `(M,)`, the clients the server aggregates.
    losses: `(M,)` mean local losses (0 for clients that did not train).
  """
  uploads: PerGroup
  healthy: chex.Array
  losses: chex.Array


def checked_uploads(rule: UploadRule, starts: PerGroup,
                    chosen: tuple[chex.Array | None, ...], params: PerGroup,
                    losses: tuple[chex.Array, ...], took_part: chex.Array,
                    faulty: chex.Array, server_key: chex.PRNGKey) -> Checked:
  """The trained models put back at their clients, the faulty clients' uploads
  corrupted (`rule.fault_kind`) and the health rule (`faults.healthy_clients`,
  with a participant's implausible loss counting as unhealthy).

  Args:
    rule: the checks' static structure.
    starts: per group, the clients' `(m_g, ...)` models at the round's start.
    chosen: per group, the positions of its training clients (None: all).
    params, losses: per group, the training clients' trained models and mean losses.
    took_part, faulty: bool `(M,)`, the participants and the faulty ones.
    server_key: the round's server key.
  """
  trained, client_losses = _placed(rule.layout, starts, chosen, params, losses)
  if rule.warmup:
    healthy, kept = _healthy_uploads(rule.layout, took_part, starts, trained,
                                     rule.outlier_factor)
    return Checked(kept, healthy, client_losses)
  trained = _with_faults(rule.layout, starts, trained, faulty, took_part,
                         jax.random.fold_in(server_key, faults_lib.FAULT_STREAM),
                         rule.fault_kind, rule.fault_scale)
  healthy, kept = _healthy_uploads(rule.layout,
                                   took_part & faults_lib.plausible_losses(client_losses),
                                   starts, trained, rule.outlier_factor)
  return Checked(kept, healthy, client_losses)


def _check(rule: UploadRule, groups: groups_lib.Groups, carry: Carry,
           inputs: RoundInputs, results: tuple[train_lib.ClientResult, ...]) -> Checked:
  """`checked_uploads` of a round's results."""
  return checked_uploads(rule, groups.algorithm.client_models(carry.state),
                         inputs.chosen, tuple(r.params for r in results),
                         tuple(r.loss for r in results), inputs.took_part,
                         inputs.faulty, inputs.server_key)


def _server_outputs(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                    inputs: RoundInputs, results: tuple[train_lib.ClientResult, ...],
                    checked: Checked) -> tuple[Carry, RoundMetrics]:
  """The server update on the checked uploads (kept for a round without any
  healthy client, `faults.keep_if_nobody`), the stored optimizer states, and
  the round's metrics."""
  state = _aggregate(groups, carry.state, checked.uploads, checked.healthy,
                     inputs.server_key)
  opt_after = _stored_opt_states(groups, carry.opt_states, inputs.chosen, results)
  opts = tuple(weights_lib.keep_masked(after, before, mask) for after, before, mask in
               zip(opt_after, carry.opt_states, _group_masks(groups, checked.healthy)))
  losses = jnp.where(inputs.took_part, checked.losses, 0.0)
  return Carry(state, opts), RoundMetrics(losses, inputs.took_part, checked.healthy,
                                          inputs.faulty)


def round_outputs(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                  inputs: RoundInputs, results: tuple[train_lib.ClientResult, ...]
                  ) -> tuple[Carry, RoundMetrics]:
  """The server step of one run after local training: new carry and metrics.

  The faulty clients' uploads are corrupted (`plan.fault_kind`), the health
  rule (`plan.outlier_factor`) drops the unhealthy ones (`checked_uploads`)
  and the algorithm's server update aggregates the rest (as `server_step`).

  A client dropped by the health rule is given back its previous optimizer
  state too, so that no stored state, whatever the algorithm keeps, can become
  non-finite: it is dropped from this round only.
  """
  checked = _check(upload_rule(plan, groups), groups, carry, inputs, results)
  return _server_outputs(plan, groups, carry, inputs, results, checked)


def _warmup_inputs(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                   feds: tuple[federation_lib.Federation, ...], seed: chex.Array
                   ) -> RoundInputs:
  """The warm-up's inputs: every client trains, with its warm-up key."""
  return inputs_from_draws(groups, carry, feds,
                           warmup_draws(schedule(plan, groups), seed))


def _warmup_from_checked(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                         inputs: RoundInputs, results: tuple[train_lib.ClientResult, ...],
                         checked: Checked) -> Carry:
  """The warm-up update (`Algorithm.warmup`) on the checked uploads; optimizer
  states kept."""
  return Carry(groups.algorithm.warmup.update(carry.state, checked.uploads,
                                              checked.healthy), carry.opt_states)


def _warmup_outputs(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                    inputs: RoundInputs, results: tuple[train_lib.ClientResult, ...]
                    ) -> Carry:
  """The algorithm's `warmup_step`; optimizer states kept."""
  checked = _check(upload_rule(plan, groups, warmup=True), groups, carry, inputs, results)
  return _warmup_from_checked(plan, groups, carry, inputs, results, checked)


Train = Callable[[tuple[ClientInputs, ...]], tuple[train_lib.ClientResult, ...]]
"""Local training of a round: per group, its training clients' results from
their `ClientInputs` (stacked, in the order given)."""


def round_step(plan: Plan, groups: groups_lib.Groups, carry: Carry,
               feds: tuple[federation_lib.Federation, ...], seed: chex.Array,
               t: chex.Array, train: Train) -> tuple[Carry, RoundMetrics]:
  """One round of one run, top to bottom: the round every pflax run takes.

  1. The round's participants and faulty clients, drawn from the run's keys,
     and each training client's inputs: starting model, stored optimizer
     state, loss context, data and training key (`round_inputs`).
  2. Local training: `train(clients)`.
  3. The faulty clients' uploads corrupted, the health rule, the server step,
     the dropped clients' optimizer states kept, and the round's metrics
     (`round_outputs`).

  `pflax.simulate` maps it over runs: with the client mapping "vmap" or "map"
  a round of all runs is this function vmapped over runs, `train` mapping the
  clients in the same program (`_phase`); with "loop" its step 1 and step 3
  are two programs over all runs, around the threaded loop over clients.
  `pflax.tune` differentiates it (`train` with each local step checkpointed). A
  Flower server takes steps 1 and 3 itself (`pflax._src.simulation.protocol`:
  the same participants, training keys and `server_step`) and its clients train.

  Args:
    plan: the sweep's static structure (participation, faults, health rule).
    groups: the algorithm, built with the run's hyperparameter values.
    carry: the run's state and stored optimizer states before the round.
    feds: per group, its clients' data (`Groups.split`).
    seed: the run's seed.
    t: the round, from 0.
    train: local training of every group's training clients.
  """
  inputs = round_inputs(plan, groups, carry, feds, seed, t)
  results = train(inputs.clients)
  return round_outputs(plan, groups, carry, inputs, results)


def warmup_round(plan: Plan, groups: groups_lib.Groups, carry: Carry,
                 feds: tuple[federation_lib.Federation, ...], seed: chex.Array,
                 train: Train) -> Carry:
  """The algorithm's warm-up (`Algorithm.warmup`) of one run, as `round_step`:
  every client trains from its warm-up key, then `warmup_step`."""
  inputs = _warmup_inputs(plan, groups, carry, feds, seed)
  results = train(inputs.clients)
  return _warmup_outputs(plan, groups, carry, inputs, results)


class _LoopSteps(NamedTuple):
  """`round_step` or `warmup_round` as the "loop" mapping runs it: the runs'
  draws and checks, each a program shared by the algorithms of a federation
  (`shared_draws`, `shared_checks`), around the algorithm's two programs
  (`inputs_from_draws`, and `server` on the checked uploads)."""
  draw: Callable[..., Draws]
  warmup: bool
  server: Callable[..., Carry | tuple[Carry, RoundMetrics]]


_LOOP_STEPS = {round_step: _LoopSteps(round_draws, False, _server_outputs),
               warmup_round: _LoopSteps(warmup_draws, True, _warmup_from_checked)}


@functools.lru_cache(maxsize=64)
def shared_draws(draw: Callable[..., Draws], schedule: Schedule
                 ) -> Callable[..., Draws]:
  """`draw(schedule, seed, *args)` of every run, jitted once per schedule.

  Returns `draws(seeds, *args)` over a leading run axis of `seeds` (`args`
  shared by the runs). Keyed by the `Schedule` alone, the program is compiled
  once for all algorithms of a federation: the key schedule is most of the
  first step's compilation on XLA-CPU.
  """
  return jax.jit(lambda seeds, *args: jax.vmap(lambda seed: draw(schedule, seed, *args))(
      seeds))


@functools.lru_cache(maxsize=64)
def shared_checks(rule: UploadRule) -> Callable[..., Checked]:
  """`checked_uploads(rule, ...)` of every run, jitted once per rule.

  Returns `checks(starts, chosen, params, losses, took_part, faulty,
  server_key)`, each with a leading run axis except `params` and `losses`,
  whose runs' clients are one axis (`_merge_runs`). Keyed by the rule alone,
  the program is compiled once for all algorithms of a federation whose
  clients' models have the same shapes: the health rule is a large part of the
  last step's compilation on XLA-CPU.
  """
  def checks(starts, chosen, params, losses, took_part, faulty, server_key):
    runs = took_part.shape[0]
    params, losses = _split_runs((params, losses), runs)
    return jax.vmap(functools.partial(checked_uploads, rule))(
        starts, chosen, params, losses, took_part, faulty, server_key)
  return jax.jit(checks)


def cast_floating(tree: types.Tree, dtype: chex.ArrayDType | None) -> types.Tree:
  """The floating leaves of `tree` in `dtype` (None: `tree` unchanged)."""
  if dtype is None:
    return tree
  floating = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.floating)
  return jax.tree.map(lambda x: x.astype(dtype) if floating(x) else x, tree)


def initial_models(models: tuple[nn.Module, ...], sizes: tuple[int, ...],
                   sample_input: chex.Array, seed: int | chex.Array,
                   dtype: chex.ArrayDType | None = None) -> PerGroup:
  """Each group's `(m_g, ...)` clients' models before round 1: one model of the
  group's architecture, drawn with the run's init key (`keys.run_keys`).

  Args:
    models: each group's Flax model (`Groups.models`).
    sizes: each group's number of clients.
    sample_input: one input batch `(1, ...)` (only its shape and dtype matter).
    seed: the run's seed.
    dtype: None, or the float dtype of the models (`cast_floating`).
  """
  key = keys_lib.run_keys(seed)[0]
  return tuple(cast_floating(models_lib.init_stacked(
      model, key, sample_input, size, same_init=True), dtype)
               for model, size in zip(models, sizes))


def _sizes(groups: groups_lib.Groups) -> tuple[int, ...]:
  return tuple(len(index) for index in groups.clients)


def initial_state(groups: groups_lib.Groups, sample_input: chex.Array,
                  class_counts: chex.Array, seed: int | chex.Array,
                  dtype: chex.ArrayDType | None = None) -> alg.State:
  """The algorithm's state before round 1, from its `initial_models`.

  Args:
    groups: the algorithm.
    sample_input: one input batch `(1, ...)` (only its shape and dtype matter).
    class_counts: `(M, K)` training class counts, as declared (`declared_counts`).
    seed: the run's seed.
    dtype: None, or the float dtype of the initial models (`cast_floating`).
  """
  params = initial_models(groups.models, _sizes(groups), sample_input, seed, dtype)
  return groups.algorithm.init(params, class_counts, keys_lib.run_keys(seed)[0])


def carry_from_models(groups: groups_lib.Groups, params: PerGroup,
                      class_counts: chex.Array, seed: int | chex.Array) -> Carry:
  """One run's initial `Carry` from its `initial_models`: the algorithm's
  `init` and each client's fresh optimizer state."""
  state = groups.algorithm.init(params, class_counts, keys_lib.run_keys(seed)[0])
  opt_states = tuple(train_lib.init_opt_state(member.optimizer, start)
                     for member, start in zip(groups.members,
                                              groups.algorithm.client_models(state)))
  return Carry(state, opt_states)


def initial_carry(groups: groups_lib.Groups, sample_input: chex.Array,
                  class_counts: chex.Array, seed: int | chex.Array,
                  dtype: chex.ArrayDType | None = None) -> Carry:
  """One run's `initial_state` and each client's fresh optimizer state."""
  params = initial_models(groups.models, _sizes(groups), sample_input, seed, dtype)
  return carry_from_models(groups, params, class_counts, seed)


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


def _clients_of_all_runs(values: chex.Array, clients: types.Tree
                         ) -> tuple[chex.Array, types.Tree]:
  """The runs' `(S, C, ...)` clients on one client axis (`_merge_runs`), and
  each client's run's value, `(S * C,)` from the runs' `values` `(S,)`."""
  return jnp.repeat(values, jax.tree.leaves(clients)[0].shape[1]), _merge_runs(clients)


def _client_trainer(plan: Plan, epochs: int, g: int
                    ) -> Callable[..., train_lib.ClientResult]:
  """One client's local training in group `g`, a function of `(value, *client)`."""
  def train_one(value, *client):
    member = plan.build(value).members[g]
    return client_trainer(member, epochs, plan.batch_size,
                          precision=plan.precision)(*client)
  return train_one


def _one_run(trainer: Callable[..., train_lib.ClientResult], strategy: str
             ) -> Callable[..., train_lib.ClientResult]:
  """`train(value, *clients)`: a group's stacked training clients of one run,
  mapped with `strategy` (`pflax.train.map_clients`), `trainer(value, *client)`
  each."""
  return lambda value, *clients: mapping.map_clients(
      functools.partial(trainer, value), strategy)(*clients)


def _runs_on_one_axis(trainer: Callable[..., train_lib.ClientResult], strategy: str
                      ) -> Callable[..., train_lib.ClientResult]:
  """`_one_run(trainer, strategy)`, except that, vmapped over runs, it trains
  the clients of all runs on one client axis.

  The vmap over runs (`_phase`) would otherwise nest around the vmap over
  clients, and XLA-GPU lays out the two batch axes of a vmapped convolution
  with extra copies: the FedAvg CNN's round of 3 seeds of 20 clients moved
  1.21x the bytes per local step of one run of their 60 clients
  (docs/performance.md). Merging the axes is a reshape (`_merge_runs`) and
  every client trains alone, so the results are those of the nested vmap;
  each client takes its run's `value`. "map" trains S clients at a time (S
  runs), as the vmap over runs of each run's one client at a time did.
  """
  train = jax.custom_batching.custom_vmap(_one_run(trainer, strategy))

  @train.def_vmap
  def train_runs(runs, batched, value, *clients):
    every_run = lambda a, b: a if b else jnp.broadcast_to(a, (runs, *jnp.shape(a)))
    value, clients = jax.tree.map(every_run, (value, clients),
                                  (batched[0], tuple(batched[1:])))
    values, clients = _clients_of_all_runs(value, clients)
    results = _split_runs(mapping.map_clients(trainer, strategy, runs)(values, *clients),
                          runs)
    return results, jax.tree.map(lambda _: True, results)
  return train


def _phase(plan: Plan, groups: groups_lib.Groups, epochs: int,
           step: Callable[..., Carry | tuple[Carry, RoundMetrics]]
           ) -> Callable[..., Carry | tuple[Carry, RoundMetrics]]:
  """`step` (`round_step` or `warmup_round`) of all runs, their clients mapped.

  `step(plan, groups, carry, feds, seed, *args, train)` is one run's. Returns
  `phase(values, carry, feds, seeds, *args)` over a leading run axis (`args`
  shared by the runs): for "vmap" and "map" `step` vmapped over runs, one
  jitted program, whose local training takes the clients of all runs on one
  client axis (`_runs_on_one_axis`, where `plan.merge_runs`); a single run's
  is called without the run axis (XLA-GPU lays out a size-1 run axis around
  the clients' with a transposing update and a copy of the dense weights
  every local step; docs/performance.md); for
  "loop" the clients of all runs trained by the threaded loop between
  `step`'s first and last steps of all runs (`_LOOP_STEPS`), each as two
  programs: the runs' draws (`shared_draws`) and their inputs, and the
  uploads' checks (`shared_checks`) and the server's update. The draws and
  the checks are shared by the algorithms of a federation: compiled once.
  """
  trainers = [_client_trainer(plan, epochs, g) for g in range(len(groups.members))]
  per_run = lambda fn, extra: jax.vmap(fn, (0, 0, 0, 0) + (None,) * len(extra))

  if plan.strategy != "loop":
    mapped = _runs_on_one_axis if plan.merge_runs else _one_run
    stacked = [mapped(trainer, plan.strategy) for trainer in trainers]

    def whole(value, carry, feds, seed, *args):
      def train(clients):
        return tuple(fn(value, *c) for fn, c in zip(stacked, clients))
      return step(plan, plan.build(value), carry, feds, seed, *args, train=train)

    def over_runs(values, carry, feds, seeds, *args):
      if values.shape[0] == 1:
        (run,) = tree_lib.unstack((values, carry, feds, seeds))
        return tree_lib.stack([whole(*run, *args)])
      return per_run(whole, args)(values, carry, feds, seeds, *args)
    return jax.jit(over_runs)

  steps = _LOOP_STEPS[step]
  draws_of = shared_draws(steps.draw, schedule(plan, groups))
  checks = shared_checks(upload_rule(plan, groups, steps.warmup))

  @jax.jit
  def before(values, carry, feds, draws):
    def one_run(value, carry, feds, draws):
      built = plan.build(value)
      return (inputs_from_draws(built, carry, feds, draws),
              built.algorithm.client_models(carry.state))
    inputs, starts = jax.vmap(one_run)(values, carry, feds, draws)
    client_values, clients = zip(*(_clients_of_all_runs(values, c)
                                   for c in inputs.clients))
    return inputs._replace(clients=None), starts, clients, client_values

  @jax.jit
  def after(values, carry, inputs, results, checked):
    results = tuple(_split_runs(r, values.shape[0]) for r in results)
    return jax.vmap(lambda value, *a: steps.server(plan, plan.build(value), *a))(
        values, carry, inputs, results, checked)

  loops = [mapping.map_clients(train, "loop") for train in trainers]

  def run_phase(values, carry, feds, seeds, *args):
    inputs, starts, clients, client_values = before(values, carry, feds,
                                                    draws_of(seeds, *args))
    results = tuple(loop(v, *c) for loop, v, c in zip(loops, client_values, clients))
    checked = checks(starts, inputs.chosen, tuple(r.params for r in results),
                     tuple(r.loss for r in results), inputs.took_part, inputs.faulty,
                     inputs.server_key)
    return after(values, carry, inputs, results, checked)
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


def _initial_models_program(models: tuple[nn.Module, ...], sizes: tuple[int, ...]
                            ) -> Callable[[chex.Array, chex.Array], PerGroup]:
  """`initial_models` of every run, `(seeds, x) -> PerGroup` with a leading run
  axis (`x`: the runs' `(S, m, n, ...)` training inputs, whose first sample
  gives the input's shape), jitted once per architectures and sizes
  (`shared_initial_models`)."""
  return jax.jit(lambda seeds, x: jax.vmap(
      lambda seed: initial_models(models, sizes, x[0, 0, :1], seed))(seeds))


shared_initial_models = functools.lru_cache(maxsize=32)(_initial_models_program)
"""`_initial_models_program` once per (hashable) models and sizes: every
algorithm of a federation with the same architectures shares the program."""


def build_programs(plan: Plan) -> Programs:
  """`programs(plan)`, built without the cache."""
  groups = plan.build(None)
  key = (groups.models, _sizes(groups))
  try:
    models_of = shared_initial_models(*key)
  except TypeError:  # a model that cannot be hashed
    models_of = _initial_models_program(*key)

  def from_models(value, counts, seed, params):
    return carry_from_models(plan.build(value), params,
                             declared_counts(plan, counts, seed), seed)

  carries = jax.jit(jax.vmap(from_models))

  def starting(values, feds, class_counts, seeds):
    return carries(values, class_counts, seeds, models_of(seeds, feds[0].x))

  warmup = groups.algorithm.warmup
  warm = _phase(plan, groups, warmup.epochs, warmup_round) if warmup else None

  def init(values, feds, class_counts, seeds):
    carry = starting(values, feds, class_counts, seeds)
    return carry if warm is None else warm(values, carry, feds, seeds)

  round_ = _phase(plan, groups, plan.local_epochs, round_step)
  return Programs(initial=starting, init=init, round=round_,
                  evaluate=jax.jit(jax.vmap(_evaluator(plan, groups))))


cached_programs = functools.lru_cache(maxsize=32)(build_programs)
"""`build_programs` once per (hashable) plan."""
