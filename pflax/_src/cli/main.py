"""`pflax-run`: run algorithms on a federated dataset, write results and plots.

The command line is parsed (`parser`), resolved into an `Invocation` (`config`),
checked (`checks`), and run: simulated (`runs`) or as Flower federations
(`federation`), on the JAX runtime of `runtime`, reported by `report`; or a
published leaderboard's presets, each algorithm a sweep of seeds (`leaderboard`).
"""

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Collection, Sequence

import jax

from pflax._src.cli import checks
from pflax._src.cli import config
from pflax._src.cli import federation
from pflax._src.cli import leaderboard
from pflax._src.cli import messages
from pflax._src.cli import parser
from pflax._src.cli import presets
from pflax._src.cli import report
from pflax._src.cli import runs
from pflax._src.cli import runtime
from pflax._src.simulation import records


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of `pflax-run` and `python -m pflax`."""
  args = parser.parser().parse_args(argv)
  try:
    with warnings.catch_warnings():
      warnings.showwarning = messages.one_line_warnings(warnings.showwarning)
      return _main(args, parser.given_flags(argv))
  except KeyboardInterrupt:
    print("pflax-run: interrupted", file=sys.stderr)
    return 130


def _main(args: argparse.Namespace, given: Collection[str]) -> int:
  """Lists the presets, prints the configuration, or checks and runs it (a
  leaderboard's settings with `--leaderboard`)."""
  if "algorithms" in given and any(map(config.importing, args.algorithms)):
    sys.path.append(os.getcwd())  # for --algorithms module:builder, never first
  if args.list_presets:
    print(presets.listing())
    return 0
  if args.leaderboard:
    return _leaderboard(args, given)
  invocation = config.invocation_from_args(args, given)
  if args.print_config:
    print(json.dumps(config.config_dict(invocation), indent=1))
    return 0
  return _started(invocation, lambda: _run(invocation))


def _leaderboard(args: argparse.Namespace, given: Collection[str]) -> int:
  """`--leaderboard`: prints each setting's configuration, or runs them all."""
  board = leaderboard.board(args.leaderboard)
  invocations = leaderboard.invocations(board, args, given)
  if args.print_config:
    print(json.dumps(leaderboard.configs(invocations), indent=1))
    return 0
  return _started(next(iter(invocations.values())),
                  lambda: leaderboard.run_and_write(board, invocations))


def _started(invocation: config.Invocation, run: Callable[[], None]) -> int:
  """Checks the run-level flags, starts JAX's runtime as they ask, and calls
  `run` holding `--out`'s lock (with `--no-compilation-cache`, in a compilation
  cache of the run's own: `runtime.run_compilation_cache`); a file that cannot
  be written is a one-line error."""
  checks.check_flags(invocation)
  if invocation.compilation_cache:
    runtime.use_compilation_cache()
  if invocation.distributed:
    runtime.join_hosts(invocation.coordinator_address, invocation.num_processes,
                       invocation.process_id)
  checks.check_device_count(invocation)
  run_cache = (contextlib.nullcontext() if invocation.compilation_cache
               else runtime.run_compilation_cache())
  try:
    with checks.out_lock(invocation.out), run_cache:
      run()
  except OSError as e:  # a full disk, a file that cannot be written
    where = f" {e.filename}" if e.filename else ""
    raise messages.fail(f"cannot write{where}: {e.strerror or e}") from None
  return 0


def _run(invocation: config.Invocation) -> None:
  """Prepares each seed's federation, then tunes or runs (simulated or with
  Flower); process 0 writes the results, on Ctrl-C those of every algorithm
  that finished."""
  runs.resume_notice(invocation)
  setups = runs.prepare(invocation)
  if invocation.tune:
    runs.tune(invocation, setups[invocation.seeds[0]])
    return
  recorded = config.config_dict(invocation)
  counts = setups[invocation.seeds[0]].federation.counts
  done = []
  try:
    if invocation.flower:
      done, recorded["flower"] = federation.federate(invocation)
    else:
      runs.simulate_all(invocation, setups, done)
  except KeyboardInterrupt:
    if done and jax.process_index() == 0:
      report.write_results(records.Results(recorded, counts, tuple(done)),
                           invocation.out)
      print(f"pflax-run: interrupted; wrote the {len(done)} finished runs",
            file=sys.stderr)
    raise
  if jax.process_index() == 0:
    report.write_results(records.Results(recorded, counts, tuple(done)),
                         invocation.out)
