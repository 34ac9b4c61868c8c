"""`pflax-run`: run algorithms on a federated dataset, write results and plots.

The command line is parsed (`parser`), resolved into an `Invocation` (`config`),
checked (`checks`), and run: simulated (`runs`) or as Flower federations
(`federation`), on the JAX runtime of `runtime`, reported by `report`.
"""

import argparse
import json
import os
import sys
import warnings
from collections.abc import Collection, Sequence

import jax

from pflax._src.cli import checks
from pflax._src.cli import config
from pflax._src.cli import federation
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
  """Lists the presets, prints the configuration, or checks and runs it."""
  if "algorithms" in given and any(map(config.importing, args.algorithms)):
    sys.path.append(os.getcwd())  # for --algorithms module:builder, never first
  if args.list_presets:
    print(presets.listing())
    return 0
  invocation = config.invocation_from_args(args, given)
  if args.print_config:
    print(json.dumps(config.config_dict(invocation), indent=1))
    return 0
  checks.check_flags(invocation)
  if invocation.compilation_cache:
    runtime.use_compilation_cache()
  if invocation.distributed:
    runtime.join_hosts(invocation.coordinator_address, invocation.num_processes,
                       invocation.process_id)
  checks.check_device_count(invocation)
  try:
    with checks.out_lock(invocation.out):
      _run(invocation)
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
