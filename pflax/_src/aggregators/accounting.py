"""The privacy accountant of client-level DP, from Google's `dp-accounting`.

One round of `pflax.privacy.dp_mean` with Poisson sampling at rate q and noise
multiplier z is `PoissonSampledDpEvent(q, GaussianDpEvent(z))`; T rounds are
that event composed T times, accounted with the RDP accountant (Mironov 2017;
Mironov, Talwar and Zhang 2019, the sampled Gaussian mechanism) under the
add-or-remove-one-client relation. `dp-accounting` is an optional dependency
(`pip install 'pflax[dp]'`), imported only here and only when called.
"""

import importlib
from typing import Any


def _dp_accounting() -> Any:
  try:
    return importlib.import_module("dp_accounting")
  except ImportError:
    raise ImportError("the privacy accountant needs dp-accounting: pip install "
                      "'pflax[dp]'") from None


def _check(rate: float, noise_multiplier: float, delta: float) -> None:
  if not 0 < rate <= 1:
    raise ValueError(f"the sampling rate q must be in (0, 1], got {rate!r}.")
  if not noise_multiplier >= 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}.")
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1), got {delta!r}.")


def round_event(rate: float, noise_multiplier: float, rounds: int = 1) -> Any:
  """`rounds` rounds as one `dp_accounting.DpEvent`."""
  dpa = _dp_accounting()
  one = dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(noise_multiplier))
  return dpa.SelfComposedDpEvent(one, rounds)


def epsilon(rate: float, noise_multiplier: float, rounds: int, delta: float) -> float:
  """eps(delta) after `rounds` rounds at sampling rate q and noise multiplier z
  (RDP accountant); `inf` for z = 0.

  >>> epsilon(1.0, 0.0, 1, 1e-5)
  inf
  """
  _check(rate, noise_multiplier, delta)
  if rounds == 0:
    return 0.0
  accountant = _dp_accounting().rdp.RdpAccountant()
  accountant.compose(round_event(rate, noise_multiplier, rounds))
  return float(accountant.get_epsilon(delta))


def epsilons(rate: float, noise_multiplier: float, rounds: int,
             delta: float) -> list[float]:
  """eps(delta) after each of rounds 1..`rounds` (one accountant, composed on)."""
  _check(rate, noise_multiplier, delta)
  dpa = _dp_accounting()
  accountant = dpa.rdp.RdpAccountant()
  out = []
  for _ in range(rounds):
    accountant.compose(round_event(rate, noise_multiplier, 1))
    out.append(float(accountant.get_epsilon(delta)))
  return out


def rounds_within(target_epsilon: float, delta: float, rate: float,
                  noise_multiplier: float, max_rounds: int) -> int:
  """The most rounds, at most `max_rounds`, whose eps(delta) is <= `target_epsilon`:
  the round after them would exceed the budget."""
  spent = epsilons(rate, noise_multiplier, max_rounds, delta)
  return sum(1 for e in spent if e <= target_epsilon)


def noise_multiplier_for(target_epsilon: float, delta: float, rate: float,
                         rounds: int) -> float:
  """The smallest z with eps(delta) <= `target_epsilon` after `rounds` rounds
  (`dp_accounting.calibrate_dp_mechanism`, bisection to a tolerance of 1e-4 in z).

  Raises:
    ValueError: for a target that is not > 0 or rounds < 1.
  """
  _check(rate, 0.0, delta)
  if not target_epsilon > 0:
    raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}.")
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds!r}.")
  dpa = _dp_accounting()
  return float(dpa.calibrate_dp_mechanism(
      dpa.rdp.RdpAccountant, lambda z: round_event(rate, z, rounds),
      target_epsilon, delta,
      bracket_interval=dpa.LowerEndpointAndGuess(0.0, 1.0), tol=1e-4))
