"""`pflax-run`'s flags: one per `ExperimentConfig` field (help and choices below),
and the run's own."""

import argparse
import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from pflax._src.cli import runtime
from pflax._src.methods import registry
from pflax._src.simulation import experiment
from pflax._src.simulation import faults as faults_lib

FIELD_HELP = {
    "dataset": "'digits' (offline) or a prepared TFDS name: mnist, fashion_mnist, "
               "cifar10, cifar100, emnist/letters",
    "data_dir": "TFDS data directory",
    "iid_fraction": "FedReMa's s for --partition groups",
    "samples_per_client": "each client's samples (unset: all it is dealt), test "
                          "samples included with --test-split clients (FedReMa: "
                          "600): --partition groups draws exactly this many, the "
                          "others keep a random subset of at most this many",
    "test_fraction": "each client's share of test samples, per class (FedReMa's 4:1: "
                     "0.2)",
    "test_split": "clients: pool the dataset's train and test splits, partition, and "
                  "split each client's data by --test-fraction (the papers); "
                  "dataset: partition the train split and test each client on the "
                  "dataset's own test split, dealt with its class mix",
    "faulty_clients": "each round this fraction of the participants, drawn from the "
                      "run's key, is faulty (see --fault-kind)",
    "fault_kind": "what faulty clients do: nan uploads NaN, scaled multiplies its "
                  "update by --fault-scale, inflated_counts declares its class "
                  "counts times --fault-scale (--faulty-clients of all clients); "
                  "attacks (docs/robustness.md): sign_flip, gaussian (noise of std "
                  "--fault-scale), alie (a little is enough), ipm (inner-product "
                  "manipulation, epsilon --fault-scale)",
    "fault_scale": "the factor of scaled (default 1e30), inflated_counts (10), "
                   "sign_flip (1), gaussian's std (1), alie's z_max (1) and ipm's "
                   "epsilon (0.1)",
    "outlier_factor": "drop a participant whose update norm exceeds this many times "
                      "the round's median (0: never)",
    "eval_every": "evaluate every N rounds (and after the last)",
    "model": "auto: the CNN for images of 16+ pixels, the MLP for digits",
    "heterogeneous": "clients use four architectures sharing the output layer "
                     "(algorithms that share a head: "
                     f"{', '.join(experiment.HEAD_SHARING)})",
    "family": "the architectures of --heterogeneous clients: cnn (three CNNs and an "
              "MLP) or mlp (four MLPs, CPU-sized)",
    "strategy": "how clients are mapped in local training",
    "precision": "local training's compute: float32, or bf16 (bfloat16 activations "
                 "and matmuls, float32 parameters and optimizer state)",
    "lr": "the clients' learning rate (FedClassAvg: its own, see --set)",
    "grad_clip": "clip each local model's gradient to this global norm (FedDWA's w "
                 "and v each on its own)",
}
FIELD_CHOICES = {"partition": experiment.PARTITIONS,
                 "test_split": experiment.TEST_SPLITS,
                 "fault_kind": faults_lib.FAULT_KINDS,
                 "model": experiment.MODELS,
                 "family": ("cnn", "mlp"),
                 "strategy": experiment.STRATEGIES,
                 "precision": ("float32", "bf16"),
                 "optimizer": ("sgd", "adam")}
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(experiment.ExperimentConfig)
                      if f.name not in ("optimizers", "hyperparameters"))
"""`ExperimentConfig` fields with a flag of their own (`--name-with-dashes`)."""


def flag(field: str) -> str:
  """The command-line flag of a field: `local_epochs` -> `--local-epochs`."""
  return "--" + field.replace("_", "-")


def _field_type(field: str) -> Any:
  """The flag's type: the field's annotation, without its `| None`."""
  annotation = {f.name: f.type for f in dataclasses.fields(experiment.ExperimentConfig)
                }[field]
  options = [t for t in typing.get_args(annotation) if t is not type(None)]
  return options[0] if options else annotation


def _add_config_flags(p: argparse.ArgumentParser) -> None:
  """`--algorithms` and a flag per field of `CONFIG_FIELDS`, defaulting to
  `ExperimentConfig()`'s values, and `--set`."""
  defaults = experiment.ExperimentConfig()
  names = tuple(registry.METHODS)
  p.add_argument("--algorithms", nargs="+", default=list(registry.DEFAULT_ALGORITHMS),
                 metavar="NAME",
                 help=f"any of {' '.join(names)}, or your own builder as "
                      "module:function (importable from the current directory)")
  for field in CONFIG_FIELDS:
    default = getattr(defaults, field)
    if isinstance(default, bool):
      p.add_argument(flag(field), action="store_true", help=FIELD_HELP.get(field))
    else:
      p.add_argument(flag(field), type=_field_type(field), default=default,
                     choices=FIELD_CHOICES.get(field),
                     help=FIELD_HELP.get(field, field.replace("_", " ")))
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a keyword of the chosen algorithms' builders (e.g. wdr_coef=10, "
                      "fedclassavg.rho=0.5) or of an algorithm's optimizer "
                      "(fedclassavg.lr=1e-4); NAME.KEY sets it for one algorithm only; "
                      "repeatable")
  p.add_argument("--download", action="store_true",
                 help="let TFDS download and prepare --dataset into --data-dir if it "
                      "is not prepared (off: fail fast, offline)")


def _add_source_flags(p: argparse.ArgumentParser) -> None:
  """Where a configuration comes from: a paper's preset, a leaderboard of them,
  a results.json."""
  p.add_argument("--list-presets", action="store_true",
                 help="list the papers' headline settings and exit")
  p.add_argument("--preset", default=None, metavar="NAME",
                 help="every value of a paper's headline setting (see "
                      "--list-presets); flags given as well override it")
  p.add_argument("--leaderboard", default=None, metavar="NAME",
                 help="run a published leaderboard (see --list-presets): each "
                      "algorithm of each of its presets, its seeds (of every "
                      "preset, when they differ only in the partition) as one sweep, "
                      "and write leaderboard.md and leaderboard.json (pflax's best "
                      "personalized accuracy next to the published one); flags "
                      "given as well override the presets")
  p.add_argument("--config", default=None, metavar="FILE",
                 help="re-run the experiment of a results.json (or of its 'config'); "
                      "flags given as well override it")
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved configuration as JSON (results.json's "
                      "'config') and exit")


def _add_sweep_flags(p: argparse.ArgumentParser) -> None:
  """The runs of each algorithm: seeds, a swept hyperparameter, or tuning."""
  p.add_argument("--seeds", type=int, nargs="+", default=[0],
                 help="several seeds run as one sweep (see --sequential)")
  p.add_argument("--sweep", default=None, metavar="HYPERPARAMETER",
                 help="also sweep this numeric hyperparameter over --values, "
                      "together with the seeds: lr or any float keyword of the "
                      "algorithm's builder (e.g. wdr_coef for cwfedavg)")
  p.add_argument("--values", type=float, nargs="+", default=[],
                 help="the values of --sweep")
  p.add_argument("--tune", nargs="+", default=None, metavar="KEY",
                 help="instead of the runs, tune these float hyperparameters of "
                      "each algorithm by gradient descent on a held-out validation "
                      "loss (pflax.tune; e.g. lr wdr_coef for cwfedavg) and write "
                      "tune_<algorithm>.json and .png")
  p.add_argument("--tune-steps", type=int, default=10,
                 help="--tune's gradient steps, each through --rounds rounds")
  p.add_argument("--tune-lr", type=float, default=0.1,
                 help="--tune's Adam learning rate in the unconstrained coordinates "
                      "(log of a positive value, logit of a fraction)")
  p.add_argument("--tune-validation", type=float, default=0.2,
                 help="--tune's share of each client's training split held out for "
                      "validation (per class)")


def _add_placement_flags(p: argparse.ArgumentParser) -> None:
  """Where the clients run: devices, hosts, or a Flower federation."""
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
  p.add_argument("--num-processes", type=int, default=None, help="processes in all")
  p.add_argument("--process-id", type=int, default=None, help="this process (0: writes)")
  p.add_argument("--flower", nargs="?", const="deployment", default=None,
                 choices=("deployment", "simulation"),
                 help="run each algorithm and seed as a Flower federation (pip "
                      "install 'pflax[flower]'): 'deployment' (the default when "
                      "given alone) starts a SuperLink and one SuperNode per client "
                      "as processes on 127.0.0.1; 'simulation' a SuperLink with "
                      "Flower's simulation engine (Ray)")
  p.add_argument("--flower-timeout", type=float, default=600.0,
                 help="seconds the Flower server waits for a round's replies; a "
                      "client that has not replied by then is dropped")
  p.add_argument("--flower-insecure", action="store_true",
                 help="run the Flower federation without TLS and SuperNode "
                      "authentication (a warning): any process on this machine "
                      "that knows the port could then use it. By default each "
                      "federation has its own certificates and node keys")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
  """How the runs go: in turn or as one sweep, what they write, what they show."""
  p.add_argument("--sequential", action="store_true",
                 help="run seeds one after another instead of as one sweep")
  p.add_argument("--out", default="runs/latest", help="output directory")
  p.add_argument("--checkpoint-every", type=int, default=0,
                 help="save a checkpoint every N rounds (0: never)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the checkpoints in --out")
  p.add_argument("--no-compilation-cache", action="store_true",
                 help="do not use JAX's persistent compilation cache (by default "
                      f"in {runtime.compilation_cache_dir()}); the run keeps one of "
                      "its own in a temporary folder, removed after it")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def parser() -> argparse.ArgumentParser:
  """`pflax-run`'s argument parser; every flag's help shows its default."""
  p = argparse.ArgumentParser(
      prog="pflax-run", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      description="Personalized federated learning experiments with pflax. With no "
                  "arguments: all eight algorithms on the offline digits dataset.")
  for add in (_add_config_flags, _add_source_flags, _add_sweep_flags,
              _add_placement_flags, _add_run_flags):
    add(p)
  return p


def given_flags(argv: Sequence[str] | None) -> frozenset[str]:
  """The destinations of the flags given on the command line."""
  quiet = parser()
  for action in quiet._actions:  # pylint: disable=protected-access
    action.default = argparse.SUPPRESS
  return frozenset(vars(quiet.parse_args(argv)))
