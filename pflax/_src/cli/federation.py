"""`pflax-run --flower`: every algorithm and seed as a Flower federation of local
processes."""

import os
import sys
from typing import Any

from pflax._src.cli import config as config_lib
from pflax._src.cli import messages
from pflax._src.cli import report
from pflax._src.cli import runtime
from pflax._src.flower import experiment as flower_experiment
from pflax._src.simulation import records


def federation_env(invocation: config_lib.Invocation) -> dict[str, str]:
  """The environment of the federation's processes: JAX's compilation cache, and
  the current directory for a `module:builder` of `--algorithms`, in
  `experiment.BUILDER_PATH` (appended to `sys.path` after the installed packages
  when the builder is imported), never on `PYTHONPATH`: there it would come
  before them, and a `sitecustomize.py` or `tqdm.py` in it would run in every
  process of the federation."""
  env = {}
  if any(map(config_lib.importing, invocation.algorithms)):
    env[flower_experiment.BUILDER_PATH] = os.getcwd()
  if invocation.compilation_cache:
    env.update(runtime.compilation_cache_env())
  return env


def federate(invocation: config_lib.Invocation
             ) -> tuple[list[records.RunRecord], dict[str, Any]]:
  """Every algorithm and seed as a Flower federation (`--flower`): the runs, and
  results.json's `config["flower"]` (engine, Flower's version, bytes per round).

  The federation's logs are written to `--out/flower-logs` and each run's
  results to `--out/flower-runs/run-N` as it goes, so that a failed or stopped
  run keeps them; SIGTERM stops the federation as SIGINT does.
  """
  import flwr  # pylint: disable=import-outside-toplevel
  from pflax._src.flower import experiment  # pylint: disable=import-outside-toplevel
  from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
  out, config = invocation.out, invocation.config
  runs, traffic = [], {}
  logs = os.path.abspath(os.path.join(out, "flower-logs"))
  kept = (f"the Flower logs are in {logs}, the results so far in "
          f"{os.path.abspath(os.path.join(out, 'flower-runs'))}")
  try:
    with runtime.sigterm_as_interrupt(), flower_deploy.LocalFederation(
        config.clients, env=federation_env(invocation),
        simulation=invocation.flower == "simulation",
        insecure=invocation.flower_insecure, log_dir=logs) as federation:
      for name in invocation.algorithms:
        for seed in invocation.seeds:
          bar = report.progress(config.rounds, f"{name} seed {seed} (flower)",
                                invocation.progress)
          results = federation.run(
              experiment.Experiment(name, config, seed),
              os.path.join(out, "flower-runs", f"run-{len(runs)}"),
              timeout=invocation.flower_timeout,
              on_round=lambda n: bar.update(n - bar.n))
          bar.close()
          run, = results.runs
          report.report(run)
          runs.append(run)
          traffic[f"{name} seed {seed}"] = results.config["flower"]["bytes_per_round"]
  except RuntimeError as e:
    raise messages.fail(f"{e}\n{kept}") from None
  except KeyboardInterrupt:
    print(f"pflax-run: stopped; {kept}", file=sys.stderr)
    raise
  return runs, {"engine": invocation.flower, "version": flwr.__version__,
                "bytes_per_round": traffic}
