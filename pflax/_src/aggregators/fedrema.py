"""FedReMa: classifiers mixed with their most relevant peers (MDS, CCP, history)."""

from collections.abc import Callable
import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib

# Similarities (cosines in [0, 1]) within this distance count as equal: above
# the float32 rounding of a cosine of soft logits (measured at most 2e-6 for up
# to 10^4 classes), far below any difference MDS is meant to find.
_SIM_TIE = 2.0 ** -17


class FedReMaState(NamedTuple):
  """Server state of FedReMa carried across rounds.

  Attributes:
    dependency: int32 `(M, M)` historical peer map `G`; `dependency[k, i]` counts
      the rounds in which client k selected client i as relevant.
    max_gap: float32 scalar, the largest mean MDS gap seen so far.
    in_ccp: bool scalar, True while in the critical co-learning period.
  """
  dependency: chex.Array
  max_gap: chex.Array
  in_ccp: chex.Array


def fedrema_init(num_clients: int) -> FedReMaState:
  """Initial state: no history, `max_gap = 0`, inside the CCP."""
  checks.integer_at_least(num_clients, "num_clients", 1)
  return FedReMaState(
      dependency=jnp.zeros((num_clients, num_clients), jnp.int32),
      max_gap=jnp.zeros((), jnp.float32),
      in_ccp=jnp.ones((), bool))


def soft_logits(logits: chex.Array, temperature: chex.Numeric = 0.5) -> chex.Array:
  """Soft logits `p_k = softmax(z_k / T)` of every client's probe logits.

  Args:
    logits: `(M, C)` logits of each client's classifier on one shared probe.
    temperature: `T > 0` (paper: 0.5).

  Returns:
    `(M, C)` float32 probabilities.

  References:
    FedReMa paper Sec. 4.1 (soft prediction with temperature M = 0.5).
  """
  if np.ndim(logits) != 2:
    raise ValueError(f"logits must have shape (M, C), got {np.shape(logits)}.")
  checks.check_range("temperature", temperature, 0.0, None, open_low=True)
  return _soft_logits(logits, temperature)


@jax.jit
def _soft_logits(logits: chex.Array, temperature: chex.Numeric) -> chex.Array:
  # Shifted by the row maximum before dividing by T: `(z - max z) / T <= 0`
  # cannot overflow, whereas `z / T` can (e.g. z = 1e30, T = 0.05 gave NaN).
  z = jnp.asarray(logits, jnp.float32)
  z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  return jax.nn.softmax(z / temperature, axis=-1)


def probe_logits(apply_fn: Callable[[types.Tree, chex.Array], chex.Array],
                 classifier_params: types.Stacked, key: chex.PRNGKey,
                 feature_dim: int) -> chex.Array:
  """Every client's classifier logits on one random probe `h ~ U[0, 1)^F`.

  Args:
    apply_fn: `apply_fn(params, h)` applies one client's classifier to features
      `h` of shape `(1, F)` and returns logits `(1, C)`.
    classifier_params: stacked classifier parameters.
    key: PRNG key for the probe, drawn once per round and shared by all clients.
    feature_dim: the classifier's input width F.

  Returns:
    `(M, C)` logits.

  Notes:
    [settled: paper, not the authors' code] One probe shared by all clients.
  """
  m = checks.num_clients(classifier_params, "classifier_params")
  checks.integer_at_least(feature_dim, "feature_dim", 1)
  probe = jax.random.uniform(key, (1, feature_dim))
  logits = jax.vmap(lambda p: apply_fn(p, probe))(classifier_params)
  return logits.reshape(m, -1)


def relevance(soft: chex.Array) -> chex.Array:
  """Relativity matrix `S`: cosine similarity of soft logits (Eq. 5), diagonal 1.

  Notes:
    Cosines are clipped to [0, 1], the range the paper states for soft logits:
    in float32 identical rows give 1.0000001, which would rank a peer above
    the client itself and drop the client from its own MDS selection.
  """
  if np.ndim(soft) != 2:
    raise ValueError(f"soft must have shape (M, C), got {np.shape(soft)}.")
  return _relevance(soft)


@jax.jit
def _relevance(soft: chex.Array) -> chex.Array:
  soft = jnp.asarray(soft, jnp.float32)
  cos = tree_lib.cosine_from_gram(jnp.matmul(soft, soft.T,
                                             precision=jax.lax.Precision.HIGHEST))
  return jnp.where(jnp.eye(soft.shape[0], dtype=bool), 1.0, jnp.clip(cos, 0.0, 1.0))


def _mds(s_row: chex.Array, valid: chex.Array) -> tuple[chex.Array, chex.Array]:
  """MDS over the valid entries of one relativity row (see `mds`)."""
  m = s_row.shape[0]
  if m <= 2:
    return valid, jnp.zeros((), s_row.dtype)
  floor = jnp.min(jnp.where(valid, s_row, jnp.inf))
  values = jnp.where(valid, s_row, floor)
  ascending = jnp.sort(values)
  gaps = jnp.diff(ascending)[:-1]
  gaps = jnp.where(gaps > _SIM_TIE, gaps, 0.0)
  cut = jnp.argmax(gaps >= jnp.max(gaps) - _SIM_TIE)
  selected = valid & (s_row >= ascending[cut + 1] - _SIM_TIE)
  few = jnp.sum(valid) <= 2
  return jnp.where(few, valid, selected), jnp.where(few, 0.0, gaps[cut])


def mds(s_row: chex.Array) -> tuple[chex.Array, chex.Array]:
  """Maximum difference segmentation (Algorithm 1) of one relativity row.

  Sorts the similarities ascending, takes consecutive gaps, excludes the top gap
  (between the client itself at 1 and its nearest peer), picks the largest
  remaining gap (the first on ties) and selects every client above it.
  Similarities within `2^-17` of each other count as equal (see Notes).

  Args:
    s_row: `(M,)` similarities of one client to all clients (its own entry 1).

  Returns:
    `(selected, gap)`: bool `(M,)` selection (the client itself and at least one
    peer) and the gap at the cut. With `M <= 2` every client is selected, gap 0.

  Notes:
    [settled: follows the authors' code; the paper's Algorithm 1 has an
    off-by-one] The client at the lower end of the cut is not selected. Ties are
    resolved by value: every client at least as similar as the lowest selected
    one is selected.
    Float32 rounding of the cosines (up to about 2e-6) decides nothing: a gap
    of at most `2^-17` is 0, gaps within `2^-17` of the largest tie with it
    (the first is cut), and clients within `2^-17` of the lowest selected one
    are selected. So identical or near-identical peers are selected together,
    and a round whose similarities differ only by rounding has gap 0.
  """
  if np.ndim(s_row) != 1:
    raise ValueError(f"s_row must have shape (M,), got {np.shape(s_row)}.")
  return _mds_all(s_row)


@jax.jit
def _mds_all(s_row: chex.Array) -> tuple[chex.Array, chex.Array]:
  s_row = jnp.asarray(s_row, jnp.float32)
  return _mds(s_row, jnp.ones(s_row.shape, bool))


def _row_normalize_or_keep(weights: chex.Array) -> chex.Array:
  """Normalises rows to sum 1; an all-zero row becomes the identity row."""
  rows = numerics.normalize(weights, weights.dtype)
  eye = jnp.eye(weights.shape[0], dtype=weights.dtype)
  return jnp.where(jnp.sum(rows, axis=1, keepdims=True) > 0, rows, eye)


def _ccp_step(soft: chex.Array, num_samples: chex.Array, valid: chex.Array,
              state: FedReMaState, delta: chex.Numeric
              ) -> tuple[chex.Array, FedReMaState]:
  """Eq. (7)-(9): MDS mixing weights and the updated history and CCP flag."""
  selected, gaps = jax.vmap(_mds, in_axes=(0, None))(_relevance(soft), valid)
  mixing = _row_normalize_or_keep(selected * num_samples[None, :])
  counted = (selected & valid[:, None]).astype(jnp.int32)
  gap_bar = jnp.sum(jnp.where(valid, gaps, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
  max_gap = jnp.maximum(state.max_gap, gap_bar)
  in_ccp = (max_gap > 0) & (gap_bar >= delta * max_gap)
  return mixing, FedReMaState(state.dependency + counted, max_gap, in_ccp)


def _history_weights(dependency: chex.Array, valid: chex.Array,
                     dtype: jnp.dtype) -> chex.Array:
  """Eq. (10): mixing weights `g_ki / sum_i g_ki` over available peers."""
  return _row_normalize_or_keep(dependency.astype(dtype) * valid[None, :])


@functools.partial(jax.jit, static_argnames=("flags",))
def _fedrema(params: types.Stacked, num_samples: chex.Array | None,
             soft: chex.Array, state: FedReMaState, mask: chex.Array | None,
             delta: chex.Numeric, *, flags: tuple[bool, ...]
             ) -> tuple[types.Stacked, FedReMaState]:
  """`fedrema` after its boundary checks, compiled once per structure."""
  m = jax.tree.leaves(params)[0].shape[0]
  dtype = numerics.weight_dtype(params)
  valid = jnp.ones((m,), bool) if mask is None else mask
  fedavg_row = weights_lib.client_weights(num_samples, m, mask, dtype)
  soft = jnp.where(valid[:, None], jnp.asarray(soft, jnp.float32), 0.0)
  ccp_mixing, ccp_state = _ccp_step(soft, fedavg_row, valid, state, delta)
  mixing = jnp.where(state.in_ccp, ccp_mixing,
                     _history_weights(state.dependency, valid, dtype))
  # Traced inputs with no unmasked client of positive weight: nothing changes.
  weighted = jnp.sum(fedavg_row) > 0
  new_state = jax.tree.map(lambda a, b: jnp.where(state.in_ccp & weighted, a, b),
                           ccp_state, state)
  classifiers, features = tree_lib.partition_flags(params, flags)
  matched = jax.tree.map(lambda x: tree_lib.mix_leaf(mixing, x),   # Eq. 7 or 10
                         weights_lib.zero_masked(classifiers, mask))
  # Masked clients keep their own classifier and receive theta like everyone
  # (Alg. 2, line 19).
  new = tree_lib.combine(
      weights_lib.keep_masked(matched, classifiers, mask),
      tree_lib.broadcast(fedavg_lib.average(features, fedavg_row, mask), m))  # Eq. 6
  return jax.tree.map(lambda a, b: jnp.where(weighted, a, b), new, params), new_state


def _check_soft(soft: chex.Array, m: int, mask: chex.Array | None) -> None:
  """`soft` is `(M, C)`; concrete rows of unmasked clients are probabilities."""
  if np.ndim(soft) != 2:
    raise ValueError(f"soft must have shape (M, C) with M = {m}, got {np.shape(soft)}.")
  checks.shape(soft, "soft", (m, np.shape(soft)[1]), "(M, C)")
  if not checks.is_concrete(soft) or (mask is not None and not checks.is_concrete(mask)):
    return
  rows = np.asarray(soft, np.float32)
  if mask is not None:
    rows = np.where(np.asarray(mask)[:, None], rows, 0.0)
  bad = np.flatnonzero(~np.all(np.isfinite(rows) & (rows >= 0), axis=1))
  if bad.size:
    raise ValueError(
        f"soft must hold finite, non-negative soft logits (probabilities, see "
        f"soft_logits) for every unmasked client; client(s) {bad.tolist()[:5]} "
        f"have NaN, inf or negative entries. Mask such clients out.")


def _check_state(state: FedReMaState, m: int) -> None:
  """Shapes and dtypes as made by `fedrema_init`; concrete values non-negative."""
  if not isinstance(state, FedReMaState):
    raise TypeError(f"state must be a FedReMaState (see fedrema_init), got "
                    f"{type(state).__name__}.")
  for name, value, shape, symbols, dtype in (
      ("state.dependency", state.dependency, (m, m), "(M, M)", jnp.int32),
      ("state.max_gap", state.max_gap, (), "()", jnp.float32),
      ("state.in_ccp", state.in_ccp, (), "()", jnp.bool_)):
    checks.shape(value, name, shape, symbols)
    if jnp.result_type(value) != dtype:
      raise TypeError(f"{name} must have dtype {jnp.dtype(dtype).name} as made by "
                      f"fedrema_init, got {jnp.result_type(value)}.")
  checks.non_negative_finite(state.dependency, "state.dependency")
  checks.non_negative_finite(state.max_gap, "state.max_gap")


def fedrema(params: types.Stacked, num_samples: chex.Array | None,
            soft: chex.Array, state: FedReMaState, *,
            where: types.Selector = tree_lib.under("classifier"),
            delta: chex.Numeric = 0.5,
            mask: chex.Array | None = None) -> tuple[types.Stacked, FedReMaState]:
  """One FedReMa server round: FedAvg features, relevance-matched classifiers.

  Leaves outside `where` (the feature extractor) get FedAvg with `n_i` weights
  (Eq. 6), broadcast to all clients. Inside the critical co-learning period each
  client k mixes the classifiers of its MDS-selected peers `A_k`,
  `phi_k = sum_{i in A_k} n_i phi_i / sum_{i in A_k} n_i` (Eq. 7), the history
  `G[k, A_k] += 1` is recorded, and the period ends for good once the mean gap
  falls below `delta` times its running maximum (Eq. 8-9). Afterwards
  `phi_k = sum_i g_ki phi_i / sum_i g_ki` (Eq. 10). All mixes read the uploaded
  snapshot.

  Args:
    params: stacked uploaded client models.
    num_samples: `(M,)` training-set sizes `|D_i|` (uniform if None).
    soft: `(M, C)` soft logits (see `soft_logits` and `probe_logits`); rows of
      masked clients may be anything, even NaN.
    state: `FedReMaState` from `fedrema_init` or the previous round.
    where: selector of the classifier leaves (default: under "classifier"); it
      must select at least one leaf.
    delta: CCP threshold (paper: 0.5).
    mask: optional bool `(M,)`; False clients are nobody's peer, receive the
      averaged feature extractor (Alg. 2, line 19), keep their own classifier,
      and their history rows are not updated.

  Returns:
    `(personalized params, new state)`.

  Raises:
    ValueError: for concrete inputs where no unmasked client has a positive
      `num_samples` (traced ones return `params` and `state` unchanged), `soft`
      with NaN or negative entries in an unmasked row, or a `where` that
      selects no leaf. TypeError or ValueError for a malformed `state`.

  Notes:
    The CCP test uses the mean gap over clients; the paper's Eq. 8 writes a sum,
    which gives the same ratio when the set of clients is fixed. It is
    `gap_bar >= delta * max_gap` (docs/methods.md#fedrema); the paper's Eq. 9 writes `>`.
    Gaps within float32 rounding are 0 (see `mds`), so a round of identical
    soft logits has gap 0 and cannot keep the CCP alive on rounding noise.

  References:
    Liang et al., "FedReMa: Improving Personalized Federated Learning via
    Leveraging the Most Relevant Clients", ECAI 2024, Eq. (5)-(10), Alg. 1-2.
  """
  m, mask = checks.client_params(params, mask)
  weights_lib.check_client_vector(num_samples, m, "num_samples")
  checks.some_weight(num_samples, mask)
  _check_soft(soft, m, mask)
  _check_state(state, m)
  checks.check_range("delta", delta, 0.0, 1.0)
  flags = tuple(tree_lib.required_selection(params, where))
  return _fedrema(params, num_samples, soft, state, mask, delta, flags=flags)
