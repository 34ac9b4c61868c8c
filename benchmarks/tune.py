"""Hypergradient tuning against the defaults and a grid, at equal compute.

For each dataset (digits; Fashion-MNIST, CPU-sized) and each setting (FedDWA's
`alpha` and `temperature`, cwFedAvg's `wdr_coef`, FedProx's `mu`; the clients'
`lr` stays at the configuration's 0.05) the keys are set three ways, each chosen
by the clients' held-out validation loss (`pflax.tune.make_task`: a fifth of
each client's training split; the test split is never used to choose):

  default  the builder's values;
  tuned    `pflax.tune.tune`: `--steps` Adam steps (in log coordinates, logit for
           FedDWA's alpha) from the defaults, each a forward and backward pass
           through R rounds with the run seed 0; the point of lowest validation
           loss is kept;
  grid     a log-spaced (logit for alpha) grid around the defaults, `--span`
           decades each side, with as many points as the tuning's compute buys,
           each an R-round run with seed 0 on the same training samples
           (`validation_loss`, the engine's rounds, vmapped in chunks); the point
           of lowest validation loss is kept.

Compute is counted in forward-run equivalents: the tuning evaluates `steps + 1`
points, each a value and hypergradient costing `g` forward runs (`g` measured in
the same process: median seconds of a gradient evaluation / median seconds of a
forward run, compilation excluded), so the grid gets `floor((steps + 1) g)`
points (`floor(sqrt(.))` per key for two keys).

The three choices are then judged on the test split only: each is re-run by
`pflax.simulate.sweep` with fresh seeds (`--test-seeds`: new initial models,
shuffles) on the clients' whole training split (validation samples returned),
and the personalized test accuracy after the last round is reported (mean and
standard deviation over the seeds). The seed-0 run's test accuracy on the
reduced training split is reported too.

Writes `--out` (JSON: every row, the timings, the tuning paths) and prints the
markdown table.

Usage:
  python benchmarks/tune.py                        # digits and fashion_mnist
  python benchmarks/tune.py --datasets digits --settings cwfedavg
  python benchmarks/tune.py --quick                # smoke run
"""

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax import simulate
from pflax import tune

SETTINGS: Mapping[str, tuple[str, ...]] = {
    "feddwa": ("alpha", "temperature"),
    "cwfedavg": ("wdr_coef",),
    "fedprox": ("mu",),
}
"""The tuned keys of each algorithm (lr fixed at the configuration's)."""

DATASETS: Mapping[str, dict[str, Any]] = {
    "digits": {"dataset": "digits", "rounds": 8},
    "fashion_mnist": {"dataset": "fashion_mnist", "samples_per_client": 300,
                      "rounds": 5},
}
"""Each dataset's configuration fields (10 clients, Dirichlet 0.3, MLP)."""

GRID_CHUNK = 8
"""Grid points per vmapped program (bounds the grid's memory)."""


def _config(dataset: str, args: argparse.Namespace) -> simulate.ExperimentConfig:
  fields = dict(DATASETS[dataset])
  if args.quick:
    fields["rounds"] = 2
  return simulate.ExperimentConfig(
      clients=args.clients, local_epochs=1, strategy="vmap", partition="dirichlet",
      dirichlet_alpha=0.3, model="mlp", eval_every=1000, **fields)


def _forward(task: tune.Task, rounds: int, seed: int) -> Callable[..., Any]:
  """A jitted R-round run vmapped over a batch of values: (loss, accuracy)."""
  tests = float(np.sum(np.asarray(task.federation.test_mask)))

  def one(values):
    out = tune.validation_loss(task, values, seed=seed, rounds=rounds)
    return out.loss, jnp.sum(out.correct) / tests
  return jax.jit(jax.vmap(one))


def _timed(fn: Callable[..., Any], *args: Any, repeats: int = 3) -> float:
  """Median seconds of `fn(*args)`, compilation excluded."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    began = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - began)
  return float(np.median(times))


def _temp_bytes(fn: Callable[..., Any], *args: Any) -> int:
  """XLA's temporaries of the compiled `fn(*args)`."""
  return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def _axis(key: str, default: float, n: int, span: float) -> np.ndarray:
  """`n` values `span` decades each side of `default`, in the key's coordinates."""
  kind = tune.parametrization(key)
  u = float(tune.to_unconstrained(default, kind))
  us = np.linspace(u - span * math.log(10), u + span * math.log(10), n)
  return np.asarray([float(tune.from_unconstrained(x, kind)) for x in us])


def _grid(defaults: Mapping[str, float], points: int, span: float
          ) -> list[dict[str, float]]:
  per_key = max(2, int(math.floor(points ** (1.0 / len(defaults)) + 1e-9)))
  axes = [_axis(k, v, per_key, span) for k, v in defaults.items()]
  return [dict(zip(defaults, combo)) for combo in itertools.product(*axes)]


def _evaluate(forward: Callable[..., Any], keys: Sequence[str],
              points: Sequence[Mapping[str, float]]) -> tuple[np.ndarray, np.ndarray]:
  """Validation losses and test accuracies of `points`, in chunks."""
  losses, accs = [], []
  for i in range(0, len(points), GRID_CHUNK):
    chunk = list(points[i:i + GRID_CHUNK])
    chunk += [chunk[-1]] * (GRID_CHUNK - len(chunk))    # one program for all chunks
    batch = {k: jnp.asarray([p[k] for p in chunk], jnp.float32) for k in keys}
    loss, acc = jax.block_until_ready(forward(batch))
    n = min(GRID_CHUNK, len(points) - i)
    losses.append(np.asarray(loss)[:n])
    accs.append(np.asarray(acc)[:n])
  return np.concatenate(losses), np.concatenate(accs)


def _rerun(name: str, config: simulate.ExperimentConfig, setup: simulate.Setup,
           values: Mapping[str, float], seeds: Sequence[int]) -> list[float]:
  """Final personalized test accuracy of `values` for each seed (one sweep), on the
  whole training split."""
  config = dataclasses.replace(config, hyperparameters={
      name: {k: float(v) for k, v in values.items()}})
  runs = simulate.sweep(name, config, list(seeds), setups={s: setup for s in seeds})
  return [float(r.history[-1].accuracy()) for r in runs]


def _setting(dataset: str, name: str, keys: Sequence[str],
             args: argparse.Namespace) -> dict[str, Any]:
  """Default, tuned and grid for one algorithm on one dataset."""
  config = _config(dataset, args)
  setup = simulate.prepare(config, 0)
  task = tune.make_task(name, config, keys, setup=setup)
  rounds, seed = config.rounds, 0
  forward = _forward(task, rounds, seed)
  one = {k: jnp.asarray([task.defaults[k]], jnp.float32) for k in keys}
  forward_seconds = _timed(forward, one)
  grad = jax.jit(jax.value_and_grad(
      lambda v: tune.validation_loss(task, v, seed=seed, rounds=rounds).loss))
  start = {k: jnp.float32(task.defaults[k]) for k in keys}
  memory = {"gradient_temp_mb": _temp_bytes(grad, start) / 2**20,
            "forward_temp_mb": _temp_bytes(forward, one) / 2**20}

  began = time.perf_counter()
  record = tune.tune(task, steps=args.steps, seed=seed,
                     optimizer=optax.adam(args.learning_rate),
                     optimizer_label=f"adam({args.learning_rate})")
  tuning_wall = time.perf_counter() - began
  step_seconds = float(np.median([p.seconds for p in record.path[1:]]))
  ratio = step_seconds / forward_seconds
  budget = (args.steps + 1) * ratio

  grid = _grid(dict(task.defaults), int(budget), args.span)
  began = time.perf_counter()
  losses, accs = _evaluate(forward, keys, grid)
  grid_wall = time.perf_counter() - began
  chosen = int(np.argmin(losses))
  default = record.path[0]
  best = record.best

  rows = {
      "default": {"values": dict(task.defaults),
                  "validation_loss": default.validation_loss,
                  "seed0_test_accuracy": default.test_accuracy, "forward_runs": 1.0},
      "tuned": {"values": dict(best.values), "validation_loss": best.validation_loss,
                "seed0_test_accuracy": best.test_accuracy, "step": best.step,
                "forward_runs": budget},
      "grid": {"values": {k: float(v) for k, v in grid[chosen].items()},
               "validation_loss": float(losses[chosen]),
               "seed0_test_accuracy": float(accs[chosen]), "points": len(grid),
               "forward_runs": float(len(grid)),
               "on_edge": _on_edge(grid, chosen, keys)},
  }
  for row in rows.values():
    accs_ = _rerun(name, config, setup, row["values"], args.test_seeds)
    row["test_accuracy"] = accs_
  summary = {"dataset": dataset, "algorithm": name, "keys": list(keys),
             "rounds": rounds, "clients": config.clients,
             "samples_per_client": config.samples_per_client,
             "seconds_per_forward_run": forward_seconds,
             "seconds_per_tuning_step": step_seconds, "gradient_over_forward": ratio,
             "tuning_seconds_with_compile": tuning_wall,
             "grid_seconds_with_compile": grid_wall, **memory, "rows": rows,
             "path": record.to_json()}
  _print_setting(summary)
  return summary


def _on_edge(grid: Sequence[Mapping[str, float]], chosen: int,
             keys: Sequence[str]) -> bool:
  """Whether the chosen grid point is at the edge of some key's axis."""
  return any(grid[chosen][k] in (min(p[k] for p in grid), max(p[k] for p in grid))
             for k in keys)


def _values(values: Mapping[str, float]) -> str:
  return ", ".join(f"{k}={v:.3g}" for k, v in values.items())


def _row_line(summary: Mapping[str, Any], kind: str) -> str:
  row = summary["rows"][kind]
  acc = 100 * np.asarray(row["test_accuracy"])
  cost = f"{row['forward_runs']:.0f}"
  if kind == "grid":
    cost += f" ({row['points']} points{', edge' if row['on_edge'] else ''})"
  if kind == "tuned":
    cost += f" ({len(summary['path']['path']) - 1} steps, best at {row['step']})"
  return (f"| {summary['dataset']} | {summary['algorithm']} | {kind} | "
          f"{_values(row['values'])} | {row['validation_loss']:.4f} | "
          f"{100 * row['seed0_test_accuracy']:.2f} | {acc.mean():.2f} ± "
          f"{acc.std():.2f} | {cost} |")


HEADER = ("| dataset | algorithm | setting | values | validation loss | test acc., "
          "seed 0 (%) | test acc., re-run (%) | forward-run equivalents |\n"
          "|---|---|---|---|---|---|---|---|")


def _print_setting(summary: Mapping[str, Any]) -> None:
  print(HEADER)
  for kind in ("default", "tuned", "grid"):
    print(_row_line(summary, kind))
  print(f"{summary['seconds_per_tuning_step']:.2f} s per tuning step, "
        f"{summary['seconds_per_forward_run']:.2f} s per forward run "
        f"({summary['gradient_over_forward']:.1f}x); temporaries "
        f"{summary['gradient_temp_mb']:.1f} MB (gradient) vs "
        f"{summary['forward_temp_mb']:.1f} MB (forward)\n", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--datasets", nargs="+", default=list(DATASETS),
                      choices=list(DATASETS))
  parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                      choices=list(SETTINGS))
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--learning-rate", type=float, default=0.3,
                      help="Adam's step in the unconstrained coordinates")
  parser.add_argument("--clients", type=int, default=10)
  parser.add_argument("--span", type=float, default=1.5,
                      help="grid decades each side of the defaults")
  parser.add_argument("--test-seeds", type=int, nargs="+", default=[1, 2, 3])
  parser.add_argument("--out", default="benchmarks/results/tune.json")
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  if args.quick:
    args.steps, args.clients, args.test_seeds = 2, 4, [1]

  began = time.perf_counter()
  summaries = [_setting(dataset, name, SETTINGS[name], args)
               for dataset in args.datasets for name in args.settings]
  total = time.perf_counter() - began
  print(HEADER)
  for summary in summaries:
    for kind in ("default", "tuned", "grid"):
      print(_row_line(summary, kind))
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
  print(f"\ntotal {total:.0f} s, peak resident memory {peak:.0f} MB, "
        f"{jax.devices()[0].device_kind}")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"total_seconds": total, "peak_rss_mb": peak,
                             "device": jax.devices()[0].device_kind,
                             "steps": args.steps, "learning_rate": args.learning_rate,
                             "span": args.span, "test_seeds": args.test_seeds,
                             "settings": summaries}, indent=1))
  first = summaries[0]
  tune.TuneRecord.from_json(first["path"]).plot(str(out.with_suffix(".png")))
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
