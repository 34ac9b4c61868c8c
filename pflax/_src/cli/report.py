"""What `pflax-run` shows and writes: progress bars, a line per run, the tables,
and results.json with its plots."""

import os
import sys
from collections.abc import Sequence
from typing import Any

from pflax._src.simulation import plots
from pflax._src.simulation import records


def progress(total: int, label: str, enabled: bool) -> Any:
  """A tqdm progress bar of `total` steps on stderr (hidden unless `enabled`)."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc=label, disable=not enabled, leave=False,
              file=sys.stderr, dynamic_ncols=True)


def report(run: records.RunRecord) -> None:
  """Prints a finished run's line: its personalized best and final accuracy."""
  summary = run.summary()
  print(f"{run.label:12s} seed {run.seed}: personalized best {summary.best:.4f} "
        f"final {summary.final:.4f} ({run.seconds:.1f} s)", flush=True)


def tune_table(records_: Sequence[Any]) -> str:
  """A Markdown table of tuning records: start and best values, validation loss
  and personalized test accuracy (%) at both."""
  values = lambda p: ", ".join(f"{k}={v:.4g}" for k, v in p.values.items())
  lines = ["| algorithm | start | best (step) | validation loss: start, best "
           "| test accuracy: start, best |", "|---|---|---|---|---|"]
  for record in records_:
    start, best = record.path[0], record.best
    lines.append(f"| {record.algorithm} | {values(start)} | {values(best)} "
                 f"({best.step}) | {start.validation_loss:.4f}, "
                 f"{best.validation_loss:.4f} | {100 * start.test_accuracy:.2f}, "
                 f"{100 * best.test_accuracy:.2f} |")
  lines.append(f"Tuned by gradient on each client's held-out validation samples; "
               f"{records_[0].rounds} rounds per step, {records_[0].optimizer}; "
               "best = lowest validation loss.")
  return "\n".join(lines)


def write_results(results: records.Results, out: str) -> None:
  """Writes `out/results.json` and the plots, and prints the table."""
  path = os.path.join(out, "results.json")
  results.save(path)
  written = plots.save_plots(results, out)
  print(results.table())
  print(f"wrote {path} and {', '.join(written)}")
