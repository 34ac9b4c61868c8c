"""How many programs a small run compiles (issue 30: compilation in seconds).

A count, not a time: a change that makes a run compile more programs (a new
program, or a recompile from a weak type or a changed static argument) fails
here whatever the machine's load.
"""

import contextlib

import flax.linen as nn
import jax
import numpy as np

from pflax import data
from pflax import simulate
from pflax._src.simulation import engine

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

# The "loop" strategy's programs of one algorithm without warm-up: the runs'
# initial models, the algorithm's initial state from them, the round's draws
# (participants and keys), the round's inputs, the clients' zero outputs, one
# client's training, the in-place write of a client's result, the uploads'
# checks (faults and health rule), the server step and the evaluation; and the
# two programs that make the run's seed into keys.
_FIRST_ALGORITHM = 12
# A second algorithm whose clients' models have the same shapes shares the
# initial models, the draws, the zero outputs, the in-place write and the
# checks: its own programs are the initial state, the round's inputs, one
# client's training, the server step and the evaluation (before issue 30: 7).
_NEXT_ALGORITHM = 5


@contextlib.contextmanager
def _counting_compiles():
  """Yields a list that receives one entry per XLA compilation."""
  seen = []
  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == _BACKEND_COMPILE:
      seen.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x.reshape((x.shape[0], -1)))))


def _dataset():
  rng = np.random.default_rng(0)
  return data.from_arrays(rng.normal(size=(120, 5)).astype(np.float32),
                          rng.integers(0, 3, 120))


def test_a_small_run_compiles_a_fixed_number_of_programs():
  config = simulate.ExperimentConfig(clients=4, rounds=3, local_epochs=1,
                                     batch_size=8, strategy="loop")
  jax.clear_caches()
  engine.cached_programs.cache_clear()
  model, dataset = _Mlp(), _dataset()
  with _counting_compiles() as compiled:
    simulate.sweep("fedavg", config, [0, 1], dataset=dataset, model=model)
  # More rounds and a second seed compile nothing more.
  assert len(compiled) == _FIRST_ALGORITHM
  with _counting_compiles() as compiled:
    simulate.sweep("fedprox", config, [0, 1], dataset=dataset, model=model)
  assert len(compiled) == _NEXT_ALGORITHM
