"""Client-level DP for a method: its server step on DP-FedAvg's noised mean.

`private(algorithm, ...)` replaces what every client uploads (the leaves that
`algorithm.uploads` declares) by one privatized value before the method's own
server step: `w + dp_mean(trained - w)` (`pflax.privacy.dp_mean`, McMahan et
al. 2018), `w` the broadcast global of those leaves. The method then averages
identical uploads, so its weights (private sample counts) no longer matter,
and its personal leaves, which never leave a client, are neither noised nor
read by the mechanism. A method whose server step is not an average of
identical uploads declares its own DP step instead (`Algorithm.private_update`:
cwFedAvg's class models, FedClassAvg's classifier beside each client's own
model). docs/privacy.md lists which methods are covered and why the others
are refused.
"""

import jax
import jax.numpy as jnp

from pflax._src.aggregators import privacy as privacy_lib
from pflax._src.core import tree as tree_lib
from pflax._src.methods import algorithm as alg

REFUSED = {
    "local": "Local uploads nothing: there is nothing to protect (run it without "
             "--dp-*)",
    "fedsa": "FedSA clusters each client's individual update by its coefficient of "
             "variation: the server reads every upload, not only their noised mean",
    "feddwa": "FedDWA weights each client's upload by its distance to every other "
              "client's: the server reads every upload, not only their noised mean",
    "fedrema": "FedReMa selects each client's peers by the similarity of their "
               "uploaded classifiers' logits: the server reads every upload",
    "fedala": "FedALA forms its upload inside the server step (the ALA mix of the "
              "trained pair), so no declared leaf holds what leaves the client",
    "moon": "MOON keeps the uploaded model as each client's previous model, which "
            "the noised mean would replace",
    "fedavg_ft": "FedAvg-FT keeps the uploaded model as each client's fine-tuned "
                 "model, which the noised mean would replace",
}
"""Why each built-in method that `private` does not cover is refused."""

_NOISE_STREAM = 0x9D9
"""The noise's key is `fold_in(server key, _NOISE_STREAM)`."""


def not_covered(algorithm: alg.Algorithm, name: str | None = None) -> str | None:
  """Why `algorithm` (called `name`) cannot run under client-level DP, or None."""
  if name in REFUSED:
    return REFUSED[name]
  if algorithm.architectures is not None:
    return "model-heterogeneous clients (--heterogeneous) are not covered"
  if algorithm.warmup is not None and not algorithm.warmup.local:
    return "its warm-up phase uploads models outside the rounds"
  if algorithm.uploads is None and algorithm.private_update is None:
    return ("it declares no uploads (Algorithm.uploads) nor a DP server step "
            "(Algorithm.private_update), or uses a robust aggregator")
  return None


def private(algorithm: alg.Algorithm, clip_norm: float, noise_multiplier: float,
            expected_participants: float, name: str | None = None) -> alg.Algorithm:
  """`algorithm` with its uploads privatized by DP-FedAvg's noised mean.

  A method that declares its own DP step (`Algorithm.private_update`) gets
  it, with the noise's key `fold_in(key, _NOISE_STREAM)`. Otherwise, each
  round, with `trained` the `(M, ...)` trained models and `start =
  client_models(state)`, the uploaded leaves of every client become
  `start + dp_mean(trained - start, key, C, z, q M, mask=mask)` (each
  participant's update clipped to C over all uploaded leaves jointly, the sum
  noised with std z C, divided by the fixed q M); then the method's own
  `server_update` runs. When no client takes part, the noised mean is still
  applied, with every client marked as taking part (their updates are zero).

  Args:
    algorithm: an algorithm whose `uploads` or `private_update` is declared,
      without a warm-up that is not local.
    clip_norm: C > 0 (`inf`: no clipping).
    noise_multiplier: z >= 0.
    expected_participants: q M > 0.
    name: the method's command-line name, for `REFUSED`'s reasons.

  Raises:
    ValueError: naming what is not covered (`not_covered`), before any work.
  """
  reason = not_covered(algorithm, name)
  if reason:
    raise ValueError(f"client-level DP does not cover {name or 'this algorithm'}: "
                     f"{reason}.")
  if not clip_norm > 0 or not noise_multiplier >= 0 or not expected_participants > 0:
    raise ValueError("client-level DP needs clip_norm > 0, noise_multiplier >= 0 and "
                     f"expected_participants > 0, got {clip_norm!r}, "
                     f"{noise_multiplier!r}, {expected_participants!r}.")
  if algorithm.private_update is not None:
    step = algorithm.private_update(clip_norm, noise_multiplier, expected_participants)
    return algorithm._replace(server_update=lambda state, trained, mask, key: step(
        state, trained, mask, jax.random.fold_in(key, _NOISE_STREAM)))

  def server_update(state, trained, mask, key):
    start = algorithm.client_models(state)
    flags = algorithm.uploads(trained)
    shared_start, _ = tree_lib.partition_flags(start, flags)
    shared, personal = tree_lib.partition_flags(trained, flags)
    updates = jax.tree.map(lambda a, b: a - b, shared, shared_start)
    mean = privacy_lib.dp_mean(updates, jax.random.fold_in(key, _NOISE_STREAM),
                               clip_norm, noise_multiplier, expected_participants,
                               mask=mask)
    m = mask.shape[0]
    released = jax.tree.map(
        lambda s, d: jnp.broadcast_to((s[0] + d).astype(s.dtype), s.shape),
        shared_start, mean)
    anyone = jnp.any(mask)
    return algorithm.server_update(
        state, tree_lib.combine(released, personal),
        mask | ~anyone & jnp.ones(m, bool), key)

  return algorithm._replace(server_update=server_update)
