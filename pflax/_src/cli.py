"""`pflax-run`: run algorithms on a federated dataset, write results and plots."""

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pflax._src import builders
from pflax._src import plots
from pflax._src import records
from pflax._src import simulate


def _parser() -> argparse.ArgumentParser:
  defaults = simulate.ExperimentConfig()
  hp = defaults
  names = tuple(builders.BUILDERS)
  p = argparse.ArgumentParser(
      prog="pflax-run",
      description="Personalized federated learning experiments with pflax. With no "
                  "arguments: all eight algorithms on the offline digits dataset.")
  p.add_argument("--algorithms", nargs="+", default=list(names), metavar="NAME",
                 help=f"any of {' '.join(names)} (default: all), or your own "
                      "builder as module:function (importable from the current "
                      "directory)")
  p.add_argument("--dataset", default=defaults.dataset,
                 help="'digits' (offline, default) or a prepared TFDS name: mnist, "
                      "fashion_mnist, cifar10, cifar100, emnist/letters")
  p.add_argument("--data-dir", default=None, help="TFDS data directory")
  p.add_argument("--partition", default=defaults.partition,
                 choices=simulate.PARTITIONS)
  p.add_argument("--classes-per-client", type=int, default=defaults.classes_per_client)
  p.add_argument("--dirichlet-alpha", type=float, default=defaults.dirichlet_alpha)
  p.add_argument("--iid-fraction", type=float, default=defaults.iid_fraction,
                 help="FedReMa's s for --partition groups")
  p.add_argument("--clients", type=int, default=defaults.clients)
  p.add_argument("--participation", type=float, default=defaults.participation)
  p.add_argument("--faulty-clients", type=float, default=defaults.faulty_clients,
                 metavar="FRACTION",
                 help="each round this fraction of the participants, drawn from the "
                      "run's key, uploads non-finite parameters; the server drops "
                      "them (default: 0)")
  p.add_argument("--rounds", type=int, default=defaults.rounds)
  p.add_argument("--eval-every", type=int, default=defaults.eval_every)
  p.add_argument("--local-epochs", type=int, default=hp.local_epochs)
  p.add_argument("--batch-size", type=int, default=hp.batch_size)
  p.add_argument("--lr", type=float, default=hp.lr)
  p.add_argument("--optimizer", default=hp.optimizer, choices=("sgd", "adam"))
  p.add_argument("--momentum", type=float, default=hp.momentum)
  p.add_argument("--grad-clip", type=float, default=hp.grad_clip,
                 help="clip each local model's gradient to this global norm (FedDWA's "
                      "w and v each on its own; default: none)")
  p.add_argument("--model", default=defaults.model, choices=("auto", "cnn", "mlp"),
                 help="auto: the CNN for images of 16+ pixels, the MLP for digits")
  p.add_argument("--heterogeneous", action="store_true",
                 help="fedclassavg only: clients use four different architectures")
  p.add_argument("--strategy", default=defaults.strategy,
                 choices=("auto", "vmap", "loop", "map"),
                 help="how clients are mapped in local training")
  p.add_argument("--seeds", type=int, nargs="+", default=[0],
                 help="several seeds run as one sweep (see --sequential)")
  p.add_argument("--sweep", default=None, metavar="HYPERPARAMETER",
                 help="also sweep this numeric hyperparameter over --values, "
                      "together with the seeds: lr or any float keyword of the "
                      "algorithm's builder (e.g. wdr_coef for cwfedavg)")
  p.add_argument("--values", type=float, nargs="+", default=[],
                 help="the values of --sweep")
  p.add_argument("--devices", type=int, default=None,
                 help="split the clients over this many devices (a 'clients' mesh "
                      "axis; on CPU, force host devices with XLA_FLAGS="
                      "--xla_force_host_platform_device_count=N)")
  p.add_argument("--distributed", action="store_true",
                 help="call jax.distributed.initialize() first (several hosts; "
                      "arguments detected on Slurm, Open MPI and Cloud TPU, else "
                      "give the three below); --devices then counts all hosts' "
                      "devices and only process 0 writes results")
  p.add_argument("--coordinator-address", default=None, help="host:port of process 0")
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)
  p.add_argument("--sequential", action="store_true",
                 help="run seeds one after another instead of as one sweep (implied "
                      "by --heterogeneous and checkpoints)")
  p.add_argument("--out", default="runs/latest", help="output directory")
  p.add_argument("--checkpoint-every", type=int, default=0,
                 help="save a checkpoint every N rounds (0: never)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the checkpoints in --out")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  return p


def config_from_args(args: argparse.Namespace) -> simulate.ExperimentConfig:
  """The experiment configuration named by command-line arguments."""
  config = simulate.ExperimentConfig(
      dataset=args.dataset, data_dir=args.data_dir, partition=args.partition,
      clients=args.clients, classes_per_client=args.classes_per_client,
      dirichlet_alpha=args.dirichlet_alpha, iid_fraction=args.iid_fraction,
      participation=args.participation, faulty_clients=args.faulty_clients,
      rounds=args.rounds, eval_every=args.eval_every, model=args.model,
      heterogeneous=args.heterogeneous, strategy=args.strategy,
      local_epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr,
      optimizer=args.optimizer, momentum=args.momentum, grad_clip=args.grad_clip)
  try:
    simulate.check_config(config)
    for name in args.algorithms:
      simulate.resolve_builder(name)
  except ValueError as e:
    raise SystemExit(f"pflax-run: {e}") from None
  return config


def _swept(args: argparse.Namespace) -> bool:
  """Whether the seeds (and --sweep values) run as one sweep."""
  several = len(args.seeds) > 1 or args.sweep is not None or args.devices
  if (args.sweep is not None or args.devices) and args.sequential:
    raise SystemExit("pflax-run: --sweep and --devices run as one sweep; they cannot "
                     "be combined with --sequential.")
  if args.devices and (args.checkpoint_every or args.resume):
    raise SystemExit("pflax-run: checkpoints are not supported with --devices.")
  if args.devices and args.strategy == "loop":
    raise SystemExit("pflax-run: --devices runs each round as one program over the "
                     "devices; use --strategy auto, vmap or map.")
  return bool(several) and not args.sequential


def _mesh(devices: int | None) -> jax.sharding.Mesh | None:
  """A one-axis `clients` mesh over the first `devices` devices (None: no mesh)."""
  if devices is None:
    return None
  if not 1 <= devices <= jax.device_count():
    raise SystemExit(f"pflax-run: --devices must be in [1, {jax.device_count()}] (the "
                     f"devices JAX sees), got {devices}; on CPU set XLA_FLAGS="
                     "--xla_force_host_platform_device_count=N.")
  return jax.make_mesh((devices,), ("clients",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _progress(total: int, label: str, enabled: bool) -> Any:
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc=label, disable=not enabled, leave=False,
              file=sys.stderr, dynamic_ncols=True)


def _table(runs: Sequence[records.RunRecord]) -> str:
  """Markdown table of accuracies per algorithm (and value), mean ± std over seeds.

  "per client" is the final unweighted mean over clients of the personalized
  models' accuracies with their std over clients in parentheses, each averaged
  over seeds; "exclusive" is FedDWA's exclusive models, one per client.
  """
  lines = ["| algorithm | personalized best | personalized final | per client final: "
           "mean (std) | global final | exclusive final |", "|---|---|---|---|---|---|"]
  for label in dict.fromkeys(r.label for r in runs):
    rs = [r for r in runs if r.label == label]
    fmt = lambda v: f"{100 * np.mean(v):.2f} ± {100 * np.std(v):.2f}"
    acc = lambda kind, field: (fmt([getattr(r.summary(kind), field) for r in rs])
                               if rs[0].summary(kind) else "—")
    clients = lambda field: 100 * np.mean([getattr(r.summary(), field) for r in rs])
    lines.append(f"| {label} | {acc('personalized', 'best')} | "
                 f"{acc('personalized', 'final')} | {clients('client_mean'):.2f} "
                 f"({clients('client_std'):.2f}) | {acc('global', 'final')} | "
                 f"{acc('exclusive', 'final')} |")
  return "\n".join(lines)


def _config_dict(config: simulate.ExperimentConfig, args: argparse.Namespace
                 ) -> dict[str, Any]:
  out = dataclasses.asdict(config)
  out["algorithms"] = list(args.algorithms)
  out["seeds"] = list(args.seeds)
  out["devices"] = args.devices
  if args.sweep:
    out["sweep"] = {args.sweep: list(args.values)}
  return out


def _report(run: records.RunRecord) -> None:
  summary = run.summary()
  print(f"{run.label:12s} seed {run.seed}: personalized best {summary.best:.4f} "
        f"final {summary.final:.4f} ({run.seconds:.1f} s)", flush=True)


def _sweep(name: str, config: simulate.ExperimentConfig, args: argparse.Namespace,
           seeds: list[int], setups: dict[int, simulate.Setup]
           ) -> list[records.RunRecord]:
  """The seeds (and --sweep values) of one algorithm as one sweep, with a progress
  bar and checkpoints as asked."""
  runs = len(seeds) * max(len(args.values), 1)
  label = f"{name} seed {seeds[0]}" if runs == 1 else f"{name} x{runs}"
  bar = _progress(config.rounds, label, not args.no_progress)

  def on_round(t, rounds):
    del t
    accs = [r.accuracy() for r in rounds if r.accuracy() is not None]
    if accs:
      bar.set_postfix(acc=f"{np.mean(accs):.3f}",
                      loss=f"{np.mean([r.train_loss for r in rounds]):.3f}")
    bar.update(1)

  checkpoints = args.out if args.checkpoint_every or args.resume else None
  try:
    out = simulate.sweep(name, config, seeds, hyperparameter=args.sweep,
                         values=args.values, setups=setups, on_round=on_round,
                         mesh=_mesh(args.devices), checkpoint_dir=checkpoints,
                         checkpoint_every=args.checkpoint_every, resume=args.resume)
  except ValueError as e:
    raise SystemExit(f"pflax-run: {e}") from None
  bar.close()
  for run in out:
    _report(run)
  return out


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of `pflax-run` and `python -m pflax`."""
  args = _parser().parse_args(argv)
  if args.distributed:
    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes,
                               process_id=args.process_id)
  sys.path.insert(0, os.getcwd())  # for --algorithms module:builder
  config = config_from_args(args)
  os.makedirs(args.out, exist_ok=True)
  setups = {seed: simulate.prepare(config, seed) for seed in args.seeds}
  runs = []
  for name in args.algorithms:
    if _swept(args):
      runs += _sweep(name, config, args, args.seeds, setups)
    else:
      for seed in args.seeds:
        runs += _sweep(name, config, args, [seed], setups)
  if jax.process_index() != 0:
    return 0
  results = records.Results(_config_dict(config, args),
                            setups[args.seeds[0]].federation.counts, tuple(runs))
  results.save(os.path.join(args.out, "results.json"))
  written = plots.write_all(results, args.out)
  print(_table(runs))
  print(f"wrote {os.path.join(args.out, 'results.json')} and {', '.join(written)}")
  return 0
