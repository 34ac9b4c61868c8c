"""The papers' headline settings as named configurations of `pflax-run --preset`.

Every value comes from the paper's text (the sources name the line of the paper
text each value was read from, `papers/<method>.txt` as shipped with the
project's contract); where a paper is silent or pflax must depart, the
description says so.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple


class Preset(NamedTuple):
  """A paper's setting: `pflax-run` flags and builder keywords, with their sources.

  Attributes:
    name: `<method>-<dataset>-<partition>`.
    description: what it reproduces, the paper's number, and every departure.
    algorithms: the algorithms it runs (the method, and the baselines the paper
      compares in that table where pflax has them).
    config: `ExperimentConfig` fields, `optimizers` and `hyperparameters`
      included.
    sources: `{key: "line N: quote"}`, where each value was read.
  """
  name: str
  description: str
  algorithms: tuple[str, ...]
  config: Mapping[str, Any]
  sources: Mapping[str, str]


_CWFEDAVG_SOURCES = {
    "clients, participation, lr, batch_size, local_epochs":
        "cwfedavg.txt line 234: 20 clients as the default participating in each "
        "round, learning rate of 0.005, batch size of 10, and 1 local epoch",
    "wdr_coef": "line 234: lambda to 10 for MNIST and CIFAR-10; Eq. 8 (line 152) adds "
                "lambda R, the authors' code 0.5 lambda R, which pflax follows: "
                "wdr_coef = lambda / 2 (SPEC section 6, docs/methods.md#cwfedavg)",
    "rounds": "line 234: Each experiment runs for 1,000 communication rounds",
    "partition": "line 230: two classes for MNIST and CIFAR-10; Dirichlet alpha = 0.1 "
                 "as the default; 75% training and 25% test splits",
    "model": "line 234: a 4-layer CNN with ReLU activation functions",
    "optimizer": "not stated (SGD, following FedAvg [18], line 234)",
}

_CWFEDAVG = dict(clients=20, participation=1.0, rounds=1000, local_epochs=1,
                 batch_size=10, optimizer="sgd", lr=0.005, model="cnn",
                 hyperparameters={"cwfedavg": {"wdr_coef": 5.0}})

_FEDCLASSAVG_SOURCES = {
    "clients": "fedclassavg.txt line 638: 20 clients were simulated",
    "lr, batch_size, rho, local_epochs": "lines 668-672 (Table 1): CIFAR-10 0.0001 64 "
                                         "0.1 1",
    "participation": "line 814: sampling rate was set to 1 for 20 clients (said of "
                     "the homogeneous-model runs; the authors' README runs Table 2 "
                     "with --c 1 too)",
    "warmup_epochs": "lines 755-757: KT-pFL initializes local models by training one "
                     "local epoch while FedClassAvg does not (0; pflax's builder "
                     "default of 1 is the authors' code, SPEC section 6)",
    "partition sizes": "line 594: the data sizes of all clients were equally "
                       "distributed (pflax's Dirichlet split does not equalise them)",
    "partition": "lines 835-837 (Table 2): Dir(0.5) for Dirichlet label distribution",
    "heterogeneous": "line 835-836: ResNet-18, ShuffleNetV2, GoogLeNet, AlexNet. "
                     "Models were equally distributed",
    "optimizer": "not stated in the text: Adam with betas (0.5, 0.999), the authors' "
                 "code (docs/methods.md#fedclassavg)",
    "rounds": "not stated in the text (the authors' code: up to 1,000 with early "
              "stopping; pflax: 200)",
}

_FEDSA_SOURCES = {
    "clients, participation, rounds, local_epochs":
        "fedsa.txt line 100: global training rounds to 1000, the number of clients "
        "to 20, and the proportion of randomly selected clients per round to 1.0; "
        "local training rounds per client to 1",
    "cv_threshold, sim_threshold, num_mic, num_mac":
        "line 102: threshold ... to 0.2, and the minimum similarity ... to 0.2; the "
        "number of MIC to 4 ... and the number of MAC to 4 ... for CIFAR-10",
    "partition": "line 98: 2 classes for CIFAR-10; Dirichlet alpha = 0.1; train/test "
                 "0.75 : 0.25",
    "model": "line 100: ResNet-18 backbone (pflax: its 4-layer CNN)",
    "optimizer, lr, batch_size": "not stated",
}

_FEDSA = dict(dataset="cifar10", clients=20, participation=1.0, rounds=1000,
              local_epochs=1, model="cnn", hyperparameters={"fedsa": {
                  "cv_threshold": 0.2, "sim_threshold": 0.2, "num_mic": 4,
                  "num_mac": 4}})

_FEDDWA_SOURCES = {
    "optimizer, local_epochs, lr, batch_size, clients, participation, rounds, "
    "lam, alpha": "feddwa.txt line 166: SGD; local training rounds 5; learning rate "
                  "0.01; batch size 16; total number of clients 20; participation "
                  "rate F 1; communication rounds 100 for CIFAR-10; lambda 1; alpha 0.2",
    "partition": "line 154: Dirichlet dir = 0.3 and 0.5; pathological: 2 classes per "
                 "client (line 210)",
    "model": "line 158: two convolutional layers with ReLU and 2x2 max pooling, then "
             "fully connected layers (pflax: its 4-layer CNN of the same shape)",
    "temperature": "line 83: the softmax of Eq. 5 has no temperature (1)",
    "split": "line 210: a training and a test set of the same distribution; ratio "
             "not stated (pflax: 75/25)",
}

_FEDDWA = dict(dataset="cifar10", clients=20, participation=1.0, rounds=100,
               local_epochs=5, batch_size=16, optimizer="sgd", lr=0.01, model="cnn",
               hyperparameters={"feddwa": {"alpha": 0.2, "lam": 1.0}})

_FEDREMA_SOURCES = {
    "optimizer, rounds, local_epochs, batch_size, lr":
        "fedrema.txt line 222: SGD; T = 500; E = 5; batch size 100; eta = 0.01",
    "partition": "line 216: five groups of clients, three dominant labels each, a "
                 "fraction s of IID data; line 230: s = 0.2",
    "temperature": "line 136: M = 0.5",
    "delta": "line 272: delta = 0.5 is the best choice",
    "momentum, grad_clip": "not stated in the text: 0.9 and 10, the authors' code "
                           "(docs/methods.md#fedrema)",
    "clients": "not stated (20)",
    "fedprox.mu": "line 222: For FedProx, mu is set to 1",
    "model": "line 220: a simplified AlexNet for CIFAR-10 (pflax: its 4-layer CNN)",
    "split": "line 230: 600 samples per client, 4:1 train/test (pflax: all samples, "
             "75/25)",
}

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("cwfedavg-cifar10-pathological",
           "cwFedAvg (Output) with WDR, Table 1: CIFAR-10, 2 classes per client; the "
           "paper reports 91.23 ± 0.04 (FedAvg 60.68). Optimizer not stated: SGD.",
           ("cwfedavg", "fedavg", "fedprox"),
           dict(_CWFEDAVG, dataset="cifar10", partition="pathological",
                classes_per_client=2), _CWFEDAVG_SOURCES),
    Preset("cwfedavg-mnist-dirichlet",
           "cwFedAvg (Output) with WDR, Table 1: MNIST, practical setting, Dirichlet "
           "alpha 0.1; the paper reports 99.52 ± 0.03 (FedAvg 98.70). The text of "
           "Table 1 (lines 205-206) has lost its column spans: pflax reads MNIST as "
           "the first practical column, since Table 3 (line 248) has only CIFAR-10 "
           "and CIFAR-100 under Pathological and line 230 orders the datasets MNIST, "
           "CIFAR-10/100, Tiny ImageNet.",
           ("cwfedavg", "fedavg", "fedprox"),
           dict(_CWFEDAVG, dataset="mnist", partition="dirichlet",
                dirichlet_alpha=0.1), _CWFEDAVG_SOURCES),
    Preset("cwfedavg-cifar10-dirichlet",
           "cwFedAvg (Output) with WDR, Table 1: CIFAR-10, practical setting, "
           "Dirichlet alpha 0.1; the paper reports 88.65 ± 0.19 (FedAvg 61.94).",
           ("cwfedavg", "fedavg", "fedprox"),
           dict(_CWFEDAVG, dataset="cifar10", partition="dirichlet",
                dirichlet_alpha=0.1), _CWFEDAVG_SOURCES),
    Preset("fedclassavg-cifar10-dirichlet-heterogeneous",
           "FedClassAvg, Table 2: CIFAR-10, Dir(0.5), 20 clients with heterogeneous "
           "models; the paper reports 0.7670 ± 0.0532 (local training 0.6894). "
           "Departures: pflax's four-architecture CNN family instead of ResNet-18, "
           "ShuffleNetV2, GoogLeNet and AlexNet; rounds not stated (200); no warm-up "
           "epoch, as the paper says (lines 755-757); client data sizes are not "
           "equalised (line 594).",
           ("fedclassavg", "local"),
           dict(dataset="cifar10", partition="dirichlet", dirichlet_alpha=0.5,
                clients=20, participation=1.0, rounds=200, local_epochs=1,
                batch_size=64, heterogeneous=True,
                optimizers={"fedclassavg": {"optimizer": "adam", "lr": 1e-4,
                                            "adam_b1": 0.5},
                            "local": {"optimizer": "adam", "lr": 1e-4, "adam_b1": 0.5}},
                hyperparameters={"fedclassavg": {"rho": 0.1, "warmup_epochs": 0}}),
           _FEDCLASSAVG_SOURCES),
    Preset("fedsa-cifar10-pathological",
           "FedSA, Table 1: CIFAR-10, 2 classes per client; the paper reports 91.36 "
           "(FedAvg 90.79), the global model's accuracy over the last rounds (compare "
           "pflax's global accuracy). Departures: pflax's CNN instead of ResNet-18; "
           "optimizer, learning rate and batch size not stated (pflax's SGD 0.05, "
           "batch 10).",
           ("fedsa", "fedavg", "fedprox"),
           dict(_FEDSA, partition="pathological", classes_per_client=2),
           _FEDSA_SOURCES),
    Preset("fedsa-cifar10-dirichlet",
           "FedSA, Table 1: CIFAR-10, practical setting, Dirichlet alpha 0.1; the "
           "paper reports 90.41 (FedAvg 88.55). Departures as for "
           "fedsa-cifar10-pathological.",
           ("fedsa", "fedavg", "fedprox"),
           dict(_FEDSA, partition="dirichlet", dirichlet_alpha=0.1), _FEDSA_SOURCES),
    Preset("feddwa-cifar10-dirichlet",
           "FedDWA, Table 1: CIFAR-10, dir = 0.3; the paper reports 86.97 (FedAvg "
           "53.44, Ditto 85.41). Eq. 5's softmax has no temperature: 1.",
           ("feddwa", "fedavg"),
           dict(_FEDDWA, partition="dirichlet", dirichlet_alpha=0.3), _FEDDWA_SOURCES),
    Preset("feddwa-cifar10-pathological",
           "FedDWA, Table A1: CIFAR-10, 2 classes per client, 20 clients, 100% "
           "participation; the paper reports 85.2 (FedAvg 39.53).",
           ("feddwa", "fedavg"),
           dict(_FEDDWA, partition="pathological", classes_per_client=2),
           _FEDDWA_SOURCES),
    Preset("fedrema-cifar10-groups",
           "FedReMa, Table 1: CIFAR-10, five groups of clients with three dominant "
           "labels, s = 0.2; the paper reports 65.4 ± 0.3% (FedAvg 61.9; FedProx "
           "with mu = 1, line 222). Departures: "
           "pflax's CNN instead of a simplified AlexNet; the number of clients is not "
           "stated (20); all of each client's samples (the paper: 600) split 75/25 "
           "(the paper: 4:1); momentum and clipping from the authors' code.",
           ("fedrema", "fedavg", "fedprox", "local"),
           dict(dataset="cifar10", partition="groups", iid_fraction=0.2, clients=20,
                participation=1.0, rounds=500, local_epochs=5, batch_size=100,
                optimizer="sgd", lr=0.01, momentum=0.9, grad_clip=10.0, model="cnn",
                hyperparameters={"fedrema": {"delta": 0.5, "temperature": 0.5},
                                 "fedprox": {"mu": 1.0}}),
           _FEDREMA_SOURCES),
)}


def names() -> tuple[str, ...]:
  return tuple(PRESETS)


def get(name: str) -> Preset:
  """The preset `name`; ValueError listing the valid names otherwise."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
  return PRESETS[name]


def listing() -> str:
  """One block per preset: name, algorithms, description."""
  blocks = []
  for p in PRESETS.values():
    blocks.append(f"{p.name}\n  algorithms: {' '.join(p.algorithms)}\n"
                  f"  {p.description}")
  return "\n".join(blocks)


def check(preset: Preset, fields: tuple[str, ...]) -> None:
  """Raises ValueError if a preset names a field `ExperimentConfig` lacks."""
  unknown = set(preset.config) - set(fields)
  if unknown:
    raise ValueError(f"preset {preset.name}: unknown fields {sorted(unknown)}")

