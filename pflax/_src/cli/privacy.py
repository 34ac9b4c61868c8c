"""`pflax-run --dp-clip C [--dp-epsilon E --dp-delta D | --dp-noise-multiplier Z]`:
the noise multiplier calibrated to the budget, or the rounds cut to it, and the
eps spent after each round (docs/privacy.md)."""

import dataclasses
from typing import Any

from pflax._src.aggregators import accounting
from pflax._src.cli import messages
from pflax._src.simulation import experiment


def planned(config: experiment.ExperimentConfig) -> experiment.ExperimentConfig:
  """`config` ready to run under client-level DP (unchanged without `dp_clip`).

  With `dp_epsilon` and no `dp_noise_multiplier`, z is calibrated so that the
  planned rounds end exactly at the budget; with both, the rounds are cut to
  those within the budget (none: refused before any work). Prints what it
  decided.
  """
  if not config.dp_clip:
    if config.dp_epsilon or config.dp_noise_multiplier is not None:
      raise messages.fail("--dp-epsilon and --dp-noise-multiplier need --dp-clip")
    return config
  q, delta = config.participation, config.dp_delta
  if config.dp_noise_multiplier is None:
    if not config.dp_epsilon:
      raise messages.fail("--dp-clip needs --dp-epsilon (to calibrate the noise) or "
                          "--dp-noise-multiplier")
    z = accounting.noise_multiplier_for(config.dp_epsilon, delta, q, config.rounds)
    print(f"client-level DP: noise multiplier z = {z:.4f} calibrated for eps = "
          f"{config.dp_epsilon:g}, delta = {delta:g} after {config.rounds} rounds at "
          f"sampling rate q = {q:g} (--participation), clip C = {config.dp_clip:g}",
          flush=True)
    return dataclasses.replace(config, dp_noise_multiplier=z)
  z = config.dp_noise_multiplier
  if config.dp_epsilon:
    rounds = accounting.rounds_within(config.dp_epsilon, delta, q, z, config.rounds)
    if rounds == 0:
      raise messages.fail(
          f"--dp-epsilon {config.dp_epsilon:g}: one round at q = {q:g}, z = {z:g} "
          f"already spends eps = {accounting.epsilon(q, z, 1, delta):.4g} "
          f"(delta = {delta:g}); nothing run")
    if rounds < config.rounds:
      print(f"client-level DP: stopping after {rounds} of {config.rounds} rounds, "
            f"the next would exceed eps = {config.dp_epsilon:g}", flush=True)
      config = dataclasses.replace(config, rounds=rounds,
                                   eval_every=min(config.eval_every, rounds))
  print(f"client-level DP: z = {z:g}, q = {q:g}, C = {config.dp_clip:g}, eps = "
        f"{accounting.epsilon(q, z, config.rounds, delta):.4g} after "
        f"{config.rounds} rounds (delta = {delta:g})", flush=True)
  return config


def spent(config: experiment.ExperimentConfig) -> list[float] | None:
  """eps(delta) after each round of `config`'s run, None without DP."""
  if not config.dp_clip:
    return None
  return accounting.epsilons(config.participation, config.dp_noise_multiplier,
                             config.rounds, config.dp_delta)


def recorded(config_dict: dict[str, Any]) -> dict[str, Any]:
  """results.json's `config` with the dp fields left out when DP is off, so a
  run without DP records what it recorded before they existed."""
  if config_dict.get("dp_clip") is None:
    for key in ("dp_clip", "dp_noise_multiplier", "dp_epsilon", "dp_delta"):
      config_dict.pop(key, None)
  return config_dict
