"""`pflax-run`'s simulated runs: each seed's federation, every algorithm's seeds
(and `--sweep` values) as sweeps, or `--tune`."""

import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pflax._src.cli import config as config_lib
from pflax._src.cli import messages
from pflax._src.cli import privacy
from pflax._src.cli import report
from pflax._src.cli import runtime
from pflax._src.data import datasets
from pflax._src.simulation import experiment
from pflax._src.simulation import records
from pflax._src.simulation import simulate


def resume_notice(invocation: config_lib.Invocation) -> None:
  """Says so on stderr when `--resume` finds no checkpoint in `--out`."""
  out = invocation.out
  if invocation.resume and not any(name.endswith(".ckpt") for name in os.listdir(out)):
    print(f"pflax-run: no checkpoint in {out}: starting from round 1", file=sys.stderr)


def prepare(invocation: config_lib.Invocation) -> dict[int, experiment.Setup]:
  """Each seed's federation (downloaded first with `--download`). A dataset that
  cannot be loaded or partitioned is an error without a traceback, its message
  (one line or several) as the library wrote it, a leading field named as its
  flag."""
  config = invocation.config
  try:
    if invocation.download:
      datasets.load(config.dataset, data_dir=config.data_dir, download=True)
    return {seed: experiment.prepare(config, seed) for seed in invocation.seeds}
  except (FileNotFoundError, ImportError, ValueError) as e:
    raise messages.fail(messages.flag_message(e)) from None


def _swept(invocation: config_lib.Invocation) -> bool:
  """Whether the seeds (and `--sweep` values) run as one sweep."""
  several = (len(invocation.seeds) > 1 or invocation.sweep is not None
             or invocation.devices)
  return bool(several) and not invocation.sequential


def _sweep(name: str, invocation: config_lib.Invocation, seeds: Sequence[int],
           setups: dict[int, experiment.Setup], mesh: jax.sharding.Mesh | None
           ) -> list[records.RunRecord]:
  """The seeds (and `--sweep` values) of one algorithm as one sweep, with a
  progress bar and checkpoints as asked."""
  config = invocation.config
  runs = len(seeds) * max(len(invocation.values), 1)
  label = f"{name} seed {seeds[0]}" if runs == 1 else f"{name} x{runs}"
  bar = report.progress(config.rounds, label, invocation.progress)

  def on_round(t, rounds):
    del t
    accs = [r.accuracy() for r in rounds if r.accuracy() is not None]
    if accs:
      bar.set_postfix(acc=f"{np.mean(accs):.3f}",
                      loss=f"{np.mean([r.train_loss for r in rounds]):.3f}")
    bar.update(1)

  checkpointed = invocation.checkpoint_every or invocation.resume
  checkpoints = invocation.out if checkpointed else None
  try:
    out = simulate.sweep(name, config, seeds, hyperparameter=invocation.sweep,
                         values=invocation.values, setups=setups, on_round=on_round,
                         mesh=mesh, checkpoint_dir=checkpoints,
                         checkpoint_every=invocation.checkpoint_every,
                         resume=invocation.resume)
  except ValueError as e:
    raise messages.fail(str(e)) from None
  bar.close()
  for run in out:
    report.report(run)
  return out


def simulate_all(invocation: config_lib.Invocation,
                 setups: dict[int, experiment.Setup],
                 done: list[records.RunRecord] | None = None
                 ) -> list[records.RunRecord]:
  """Every algorithm's runs, on the `--devices` mesh if any: its seeds as one
  sweep (`_swept`), else each seed as a sweep of its own. Each sweep's records
  are appended to `done` as it finishes (what Ctrl-C keeps); returns `done`."""
  mesh = runtime.mesh(invocation.devices)
  seed_groups = ([list(invocation.seeds)] if _swept(invocation)
                 else [[seed] for seed in invocation.seeds])
  done = [] if done is None else done
  spent = privacy.spent(invocation.config)
  for name in invocation.algorithms:
    for seeds in seed_groups:
      done += _with_epsilon(_sweep(name, invocation, seeds, setups, mesh), spent)
  if spent is not None:
    print(f"client-level DP: eps = {spent[-1]:.4g} spent (delta = "
          f"{invocation.config.dp_delta:g})", flush=True)
  return done


def _with_epsilon(runs: list[records.RunRecord], spent: list[float] | None
                  ) -> list[records.RunRecord]:
  """The runs with each round's privacy spent (`privacy.spent`) recorded, if any."""
  if spent is None:
    return runs
  return [dataclasses.replace(run, history=tuple(
      dataclasses.replace(rec, epsilon=e) for rec, e in zip(run.history, spent)))
          for run in runs]


def tune(invocation: config_lib.Invocation, setup: experiment.Setup) -> list[Any]:
  """`--tune`: each algorithm's keys tuned by gradient (`pflax.tune.tune`) from
  their configured values, its path written as `tune_<algorithm>.json` and
  `.png` in `--out`; the records."""
  import optax  # pylint: disable=import-outside-toplevel
  from pflax._src.simulation import tune as tune_lib  # pylint: disable=import-outside-toplevel
  recorded = []
  for name in invocation.algorithms:
    try:
      task = tune_lib.make_task(name, invocation.config, invocation.tune, setup=setup,
                                validation_fraction=invocation.tune_validation)
    except ValueError as e:
      raise messages.fail(f"--tune: {messages.flag_message(e)}") from None
    bar = report.progress(invocation.tune_steps + 1, f"{name} tune",
                          invocation.progress)

    def on_step(point, bar=bar):
      bar.set_postfix(val=f"{point.validation_loss:.3f}")
      bar.update(1)

    lr = invocation.tune_lr
    record = tune_lib.tune(task, steps=invocation.tune_steps, seed=invocation.seeds[0],
                           optimizer=optax.adam(lr), optimizer_label=f"adam({lr:g})",
                           on_step=on_step)
    bar.close()
    stem = os.path.join(invocation.out, "tune_" + "".join(
        c if c.isalnum() or c in "-_" else "_" for c in name))
    record.save(stem + ".json")
    record.plot(stem + ".png")
    recorded.append(record)
  print(report.tune_table(recorded))
  print(f"wrote tune_*.json and tune_*.png in {invocation.out}")
  return recorded
