"""The papers' headline settings as named configurations of `pflax-run --preset`,
and the published leaderboards that group them (`pflax-run --leaderboard`).

Every value comes from the paper's text (the sources name the line of the paper
text each value was read from, `papers/<method>.txt` as shipped with the
project's contract); where a paper is silent or pflax must depart, the
description says so. Each preset stores the accuracies the paper reports for
its algorithms (`paper`).
"""

from collections.abc import Mapping
from typing import Any, NamedTuple


class Preset(NamedTuple):
  """A paper's setting: `pflax-run` flags and builder keywords, with their sources.

  Attributes:
    name: `<method>-<dataset>-<partition>[-<variant>]` (`fmnist`: Fashion-MNIST).
    description: what it reproduces, the paper's number, and every departure.
    algorithms: the algorithms it runs (the method, and the baselines the paper
      compares in that table where pflax has them).
    config: `ExperimentConfig` fields, `optimizers` and `hyperparameters`
      included.
    sources: `{key: "line N: quote"}`, where each value was read (`paper`:
      where the reported accuracies were read).
    paper: `{algorithm: accuracy}`, the mean accuracy the paper reports for
      each of `algorithms` in this setting, as printed: percent, except
      FedClassAvg's fractions of 1.
    seeds: the seeds `pflax-run` runs (`--seeds` overrides them): as many as
      the paper repeats its runs where it says so, else one.
  """
  name: str
  description: str
  algorithms: tuple[str, ...]
  config: Mapping[str, Any]
  sources: Mapping[str, str]
  paper: Mapping[str, float]
  seeds: tuple[int, ...] = (0,)


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
    "participation": "line 814: sampling rate was set to 1 for 20 clients (said of "
                     "the homogeneous-model runs; the authors' README runs Table 2 "
                     "with --c 1 too)",
    "warmup_epochs": "lines 755-757: KT-pFL initializes local models by training one "
                     "local epoch while FedClassAvg does not (0; pflax's builder "
                     "default of 1 is the authors' code, SPEC section 6)",
    "partition sizes": "line 594: the data sizes of all clients were equally "
                       "distributed (pflax's Dirichlet split does not equalise them)",
    "test_split": "line 735: evaluated based on average performance on test datasets "
                  "consistent with local data distributions; the authors' code draws "
                  "each client's test set from the dataset's test split with its "
                  "training label mix (src/utils.py, get_local_test_indices): "
                  "'dataset'",
    "optimizer": "not stated in the text: Adam with betas (0.5, 0.999), the authors' "
                 "code (docs/methods.md#fedclassavg)",
    "rounds": "not stated in the text (the authors' code: up to 1,000 with early "
              "stopping; pflax: 200)",
}

_FEDCLASSAVG_HETEROGENEOUS = {
    "heterogeneous": "lines 835-836: ResNet-18, ShuffleNetV2, GoogLeNet, AlexNet. "
                     "Models were equally distributed",
}

_FEDCLASSAVG_DIRICHLET = {
    "partition": "lines 835-837 (Table 2): Dir(0.5) for Dirichlet label distribution",
}

_FEDCLASSAVG_FMNIST = {
    "lr, batch_size, rho, local_epochs": "line 672 (Table 1): Fashion-MNIST 0.0006 64 "
                                         "0.4662 1",
    "fedavg, fedprox": "not stated: the same optimizer (the authors' code trains "
                       "every model with Adam, betas (0.5, 0.999), at the dataset's "
                       "learning rate: src/heteropfl_utils.py, train); FedProx's mu "
                       "not stated (pflax's 0.001)",
}

_FMNIST_CLASSAVG = dict(dataset="fashion_mnist", clients=20, participation=1.0,
                        rounds=200, local_epochs=1, batch_size=64, test_split="dataset",
                        optimizer="adam", lr=0.0006, adam_b1=0.5, optimizers={})
"""FedClassAvg's Fashion-MNIST base (Table 1, line 672): every algorithm trains with
it, so no per-algorithm optimizer."""

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
    "optimizer, local_epochs, lr, batch_size, lam, alpha":
        "feddwa.txt line 166: SGD; local training rounds 5; learning rate 0.01; "
        "batch size 16; lambda 1; alpha 0.2",
    "clients, participation, rounds": "line 166: total number of clients 20; "
                                      "participation rate F 1; communication rounds "
                                      "100 for CIFAR-10",
    "partition": "line 154: Dirichlet dir = 0.3 and 0.5; pathological: 2 classes per "
                 "client (line 210)",
    "model": "line 158: two convolutional layers with ReLU and 2x2 max pooling, then "
             "fully connected layers (pflax: its 4-layer CNN of the same shape)",
    "temperature": "line 83: the softmax of Eq. 5 has no temperature (1)",
    "split": "line 210: a training and a test set of the same distribution; ratio "
             "not stated (pflax: 75/25)",
}

_FEDDWA_20_CLIENTS = (
    "line 210: When the total number of clients was 20, assuming that 100% of the "
    "clients participate in training, the total number of global communications "
    "used for training was 100 times")

_FEDDWA_FMNIST = {
    "dataset": "line 153: FMNIST includes 60,000 training images and 10,000 test "
               "images (pflax pools them, as for every 75/25 split)",
    "partition": "line 210: the data of each client consisted of data corresponding "
                 "to 2 random categories; line 154: the data samples owned by each "
                 "client were disjoint",
}

_FEDDWA = dict(dataset="cifar10", clients=20, participation=1.0, rounds=100,
               local_epochs=5, batch_size=16, optimizer="sgd", lr=0.01, model="cnn",
               hyperparameters={"feddwa": {"alpha": 0.2, "lam": 1.0}})

_FEDREMA_SOURCES = {
    "optimizer, rounds, local_epochs, batch_size, lr":
        "fedrema.txt line 222: SGD; T = 500; E = 5; batch size 100; eta = 0.01",
    "partition": "line 216: five groups of clients, three dominant labels each, a "
                 "fraction s of IID data; line 230: s = 0.2",
    "samples_per_client, test_fraction":
        "line 230: we initially set the sample size for each client to be 600 and "
        "divided it via a 4:1 ratio for both training and testing (pflax: 600 "
        "drawn with the groups' exact class quotas, split 0.2 per class: 484 / 116; "
        "line 216 draws them from the training images, pflax from train and test "
        "pooled)",
    "seeds": "line 230: Each set of experiments were repeated 5 times with "
             "different random seeds",
    "participation": "line 189 (Algorithm 2): foreach client k in K in parallel",
    "temperature": "line 136: M = 0.5",
    "delta": "line 272: delta = 0.5 is the best choice",
    "momentum, grad_clip": "not stated in the text: 0.9 and 10, the authors' code "
                           "(docs/methods.md#fedrema)",
    "clients": "not stated (20)",
    "fedprox.mu": "line 222: For FedProx, mu is set to 1",
}

_FEDREMA = dict(partition="groups", iid_fraction=0.2, samples_per_client=600,
                test_fraction=0.2, clients=20, participation=1.0, rounds=500,
                local_epochs=5, batch_size=100, optimizer="sgd", lr=0.01,
                momentum=0.9, grad_clip=10.0, model="cnn",
                hyperparameters={"fedrema": {"delta": 0.5, "temperature": 0.5},
                                 "fedprox": {"mu": 1.0}})

_FIVE_SEEDS = (0, 1, 2, 3, 4)

_PFLLIB = dict(dataset="fashion_mnist", clients=20, participation=1.0, rounds=2000,
               local_epochs=1, batch_size=10, optimizer="sgd", lr=0.005,
               test_fraction=0.25, model="cnn")

_PFLLIB_ALGORITHMS = ("fedavg", "fedprox", "fedper", "ditto", "fedrep", "fedbabu",
                      "apfl", "fedala")

_PFLLIB_SOURCES = {
    "clients, participation, rounds, local_epochs, batch_size, optimizer, lr, "
    "test_fraction":
        "PFLlib (Zhang et al., github.com/TsingZ0/PFLlib) leaderboard, README "
        "'Experimental Results': 20 clients, all joining, 2000 rounds, 1 local epoch, "
        "batch size 10, SGD with learning rate 0.005, 75% of each client's data for "
        "training and 25% for testing; the best test accuracy over the rounds",
    "model": "PFLlib's 4-layer CNN for Fashion-MNIST (FedAvgCNN), which is pflax's "
             "CNN",
}


def _pfllib(partition: str, label: str, numbers: Mapping[str, float],
            **fields: Any) -> Preset:
  """A PFLlib leaderboard setting on Fashion-MNIST (its published accuracies)."""
  return Preset(
      f"pfllib-fmnist-{partition}",
      f"PFLlib leaderboard, Fashion-MNIST, {label}, 20 clients: the baselines' "
      f"published accuracies (FedAvg {numbers['fedavg']}). Departures: PFLlib's "
      "partitions give clients unequal sizes (pflax's are near-equal); hyperparameters "
      "of the methods are pflax's defaults where the leaderboard states none.",
      _PFLLIB_ALGORITHMS, dict(_PFLLIB, partition=partition, **fields),
      {**_PFLLIB_SOURCES,
       "partition": f"the leaderboard's {label} column (its README does not state "
                    "the classes per pathological client or the generator's "
                    "balance; pflax: 2 classes, near-equal sizes)",
       "paper": "PFLlib README, 'Experimental Results', Fashion-MNIST, " + label + ": "
                + ", ".join(f"{k} {v}" for k, v in numbers.items())},
      dict(numbers))


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("cwfedavg-cifar10-pathological",
           "cwFedAvg (Output) with WDR, Table 1: CIFAR-10, 2 classes per client; the "
           "paper reports 91.23 ± 0.04 (FedAvg 60.68). Optimizer not stated: SGD.",
           ("cwfedavg", "fedavg", "fedprox"),
           dict(_CWFEDAVG, dataset="cifar10", partition="pathological",
                classes_per_client=2),
           {**_CWFEDAVG_SOURCES, "paper": "lines 207-215 (Table 1, pathological "
            "CIFAR-10): FedAvg 60.68, FedProx 60.65, cwFedAvg (Output) 91.23"},
           {"cwfedavg": 91.23, "fedavg": 60.68, "fedprox": 60.65}),
    Preset("cwfedavg-mnist-dirichlet",
           "cwFedAvg (Output) with WDR, Table 1: MNIST, practical setting, Dirichlet "
           "alpha 0.1; the paper reports 99.52 ± 0.03 (FedAvg 98.70). The text of "
           "Table 1 (lines 205-206) has lost its column spans: pflax reads MNIST as "
           "the first practical column, since Table 3 (line 248) has only CIFAR-10 "
           "and CIFAR-100 under Pathological and line 230 orders the datasets MNIST, "
           "CIFAR-10/100, Tiny ImageNet.",
           ("cwfedavg", "fedavg", "fedprox"),
           dict(_CWFEDAVG, dataset="mnist", partition="dirichlet",
                dirichlet_alpha=0.1),
           {**_CWFEDAVG_SOURCES, "paper": "lines 207-215 (Table 1, MNIST): FedAvg "
            "98.70, FedProx 98.68, cwFedAvg (Output) 99.52"},
           {"cwfedavg": 99.52, "fedavg": 98.70, "fedprox": 98.68}),
    Preset("cwfedavg-cifar10-dirichlet",
           "cwFedAvg (Output) with WDR, Table 1: CIFAR-10, practical setting, "
           "Dirichlet alpha 0.1; the paper reports 88.65 ± 0.19 (FedAvg 61.94).",
           ("cwfedavg", "fedavg", "fedprox"),
           dict(_CWFEDAVG, dataset="cifar10", partition="dirichlet",
                dirichlet_alpha=0.1),
           {**_CWFEDAVG_SOURCES, "paper": "lines 207-215 (Table 1, practical "
            "CIFAR-10): FedAvg 61.94, FedProx 62.48, cwFedAvg (Output) 88.65"},
           {"cwfedavg": 88.65, "fedavg": 61.94, "fedprox": 62.48}),
    Preset("fedclassavg-cifar10-dirichlet-heterogeneous",
           "FedClassAvg, Table 2: CIFAR-10, Dir(0.5), 20 clients with heterogeneous "
           "models; the paper reports 0.7670 ± 0.0532 (local training 0.6894). "
           "Departures: pflax's four-architecture CNN family instead of ResNet-18, "
           "ShuffleNetV2, GoogLeNet and AlexNet; rounds not stated (200); no warm-up "
           "epoch, as the paper says (lines 755-757); client data sizes are not "
           "equalised (line 594); each client's test set is dealt from the test "
           "split in proportion to its training classes (the authors' code samples "
           "0.3 times its training size, with replacement).",
           ("fedclassavg", "local"),
           dict(dataset="cifar10", partition="dirichlet", dirichlet_alpha=0.5,
                clients=20, participation=1.0, rounds=200, local_epochs=1,
                batch_size=64, heterogeneous=True, test_split="dataset",
                optimizers={"fedclassavg": {"optimizer": "adam", "lr": 1e-4,
                                            "adam_b1": 0.5},
                            "local": {"optimizer": "adam", "lr": 1e-4, "adam_b1": 0.5}},
                hyperparameters={"fedclassavg": {"rho": 0.1, "warmup_epochs": 0}}),
           {**_FEDCLASSAVG_SOURCES, **_FEDCLASSAVG_HETEROGENEOUS,
            **_FEDCLASSAVG_DIRICHLET,
            "lr, batch_size, rho, local_epochs": "lines 666-670 (Table 1): CIFAR-10 "
                                                 "0.0001 64 0.1 1",
            "paper": "lines 846-851 (Table 2, CIFAR-10 Dir(0.5)): Baseline (local "
                     "training) 0.6894, Proposed 0.7670"},
           {"fedclassavg": 0.7670, "local": 0.6894}),
    Preset("fedclassavg-fmnist-dirichlet-heterogeneous",
           "FedClassAvg, Table 2: Fashion-MNIST, Dir(0.5), 20 clients with "
           "heterogeneous models; the paper reports 0.9303 ± 0.0308 (local training "
           "0.8840), also Table 4's full model (+PR, CL). Departures as for "
           "fedclassavg-cifar10-dirichlet-heterogeneous.",
           ("fedclassavg", "local"),
           dict(_FMNIST_CLASSAVG, partition="dirichlet", dirichlet_alpha=0.5,
                heterogeneous=True,
                hyperparameters={"fedclassavg": {"rho": 0.4662, "warmup_epochs": 0}}),
           {**_FEDCLASSAVG_SOURCES, **_FEDCLASSAVG_HETEROGENEOUS,
            **_FEDCLASSAVG_DIRICHLET, **_FEDCLASSAVG_FMNIST,
            "paper": "lines 846-851 (Table 2, Fashion-MNIST Dir(0.5)): Baseline "
                     "(local training) 0.8840, Proposed 0.9303; line 948 (Table 4): "
                     "+PR, CL 0.9303"},
           {"fedclassavg": 0.9303, "local": 0.8840}),
    Preset("fedclassavg-fmnist-pathological-heterogeneous",
           "FedClassAvg, Table 2: Fashion-MNIST, Skewed (2 classes per client), 20 "
           "clients with heterogeneous models; the paper reports 0.9800 ± 0.0281 "
           "(local training 0.9430). Departures as for "
           "fedclassavg-cifar10-dirichlet-heterogeneous; pflax's pathological split "
           "gives each client 2 classes of disjoint samples (the authors' code draws "
           "2 random classes per client and N/(2M) samples of each, with "
           "replacement).",
           ("fedclassavg", "local"),
           dict(_FMNIST_CLASSAVG, partition="pathological", classes_per_client=2,
                heterogeneous=True,
                hyperparameters={"fedclassavg": {"rho": 0.4662, "warmup_epochs": 0}}),
           {**_FEDCLASSAVG_SOURCES, **_FEDCLASSAVG_HETEROGENEOUS, **_FEDCLASSAVG_FMNIST,
            "partition": "lines 590-592: skewed class distribution where each client "
                         "holds datasets with only two sampled classes; line 837: "
                         "Skewed ... clients only contain two classes",
            "paper": "lines 846-851 (Table 2, Fashion-MNIST Skewed): Baseline (local "
                     "training) 0.9430, Proposed 0.9800"},
           {"fedclassavg": 0.9800, "local": 0.9430}),
    Preset("fedclassavg-fmnist-dirichlet",
           "FedClassAvg, Table 3: Fashion-MNIST, Dir(0.5), 20 clients with one "
           "architecture, only the classifier shared (the first scenario, lines "
           "780-784); the paper reports 0.9294 ± 0.0304 (FedAvg 0.8988, FedProx "
           "0.9025). Departures: pflax's CNN instead of ResNet-18 (FedAvg and "
           "FedProx ran on the FedAvg paper's CNN, which pflax's is); FedAvg's and "
           "FedProx's optimizer and FedProx's mu not stated (FedClassAvg's Adam, "
           "pflax's mu 0.001); rounds not stated (200).",
           ("fedclassavg", "fedavg", "fedprox"),
           dict(_FMNIST_CLASSAVG, partition="dirichlet", dirichlet_alpha=0.5,
                model="cnn",
                hyperparameters={"fedclassavg": {"rho": 0.4662, "warmup_epochs": 0}}),
           {**_FEDCLASSAVG_SOURCES, **_FEDCLASSAVG_FMNIST,
            "partition": "line 808: Data heterogeneity was assumed to be Dir(0.5)",
            "model": "lines 804-806: ResNet-18 backbone layers as feature extractors "
                     "(pflax: its CNN); lines 885-886: FedAvg ... measured on the "
                     "same convolutional architecture as FedAvg paper",
            "paper": "lines 893-898 (Table 3, Fashion-MNIST, 20 clients): FedAvg "
                     "0.8988, FedProx 0.9025, Proposed 0.9294"},
           {"fedclassavg": 0.9294, "fedavg": 0.8988, "fedprox": 0.9025}),
    Preset("fedclassavg-fmnist-dirichlet-100-clients",
           "FedClassAvg, Table 3: Fashion-MNIST, Dir(0.5), 100 clients with one "
           "architecture, 10% of them per round; the paper reports 0.6712 ± 0.1605 "
           "(FedAvg 0.7471, FedProx 0.7477). Departures as for "
           "fedclassavg-fmnist-dirichlet.",
           ("fedclassavg", "fedavg", "fedprox"),
           dict(_FMNIST_CLASSAVG, partition="dirichlet", dirichlet_alpha=0.5,
                clients=100, participation=0.1, model="cnn",
                hyperparameters={"fedclassavg": {"rho": 0.4662, "warmup_epochs": 0}}),
           {**_FEDCLASSAVG_SOURCES, **_FEDCLASSAVG_FMNIST,
            "clients, participation": "lines 812-814: when the total number of "
                                      "clients was 20 and 100. The client sampling "
                                      "rate was set to 1 for 20 clients and 0.1 for "
                                      "100 clients",
            "partition": "line 808: Data heterogeneity was assumed to be Dir(0.5)",
            "model": "lines 804-806: ResNet-18 backbone layers as feature extractors "
                     "(pflax: its CNN); lines 885-886: FedAvg ... measured on the "
                     "same convolutional architecture as FedAvg paper",
            "paper": "lines 893-898 (Table 3, Fashion-MNIST, 100 clients): FedAvg "
                     "0.7471, FedProx 0.7477, Proposed 0.6712"},
           {"fedclassavg": 0.6712, "fedavg": 0.7471, "fedprox": 0.7477}),
    *(Preset(f"fedclassavg-fmnist-ablation-{column}",
             f"FedClassAvg, Table 4 (ablation), column {label}: "
             f"fedclassavg-fmnist-dirichlet-heterogeneous with {change}; the paper "
             f"reports {number}. The column +PR, CL is that preset (0.9303).",
             ("fedclassavg",),
             dict(_FMNIST_CLASSAVG, partition="dirichlet", dirichlet_alpha=0.5,
                  heterogeneous=True, hyperparameters={"fedclassavg": {
                      "rho": rho, "supcon": supcon, "warmup_epochs": 0}}),
             {**_FEDCLASSAVG_SOURCES, **_FEDCLASSAVG_HETEROGENEOUS,
              **_FEDCLASSAVG_DIRICHLET, **_FEDCLASSAVG_FMNIST,
              "rho, supcon": "lines 942-943: CA: classifier averaging, PR: proximal "
                             "regularization, and CL: contrastive loss (rho = 0: no "
                             "PR; supcon = False: no CL)",
              "setting": "line 948: its last column (0.9303) is Table 2's "
                         "Fashion-MNIST Dir(0.5) (line 851): the heterogeneous "
                         "setting",
              "paper": f"line 948 (Table 4, Fashion-MNIST): {label} {number}"},
             {"fedclassavg": number})
      for column, label, change, rho, supcon, number in (
          ("ca", "CA", "classifier averaging alone (no proximal term, no SupCon)",
           0.0, False, 0.8578),
          ("ca-pr", "+PR", "the proximal term and no SupCon", 0.4662, False,
           0.8971),
          ("ca-cl", "+CL", "SupCon and no proximal term", 0.0, True, 0.924))),
    Preset("fedsa-cifar10-pathological",
           "FedSA, Table 1: CIFAR-10, 2 classes per client; the paper reports 91.36 "
           "(FedAvg 90.79), the global model's accuracy over the last rounds (compare "
           "pflax's global accuracy). Departures: pflax's CNN instead of ResNet-18; "
           "optimizer, learning rate and batch size not stated (pflax's SGD 0.05, "
           "batch 10).",
           ("fedsa", "fedavg", "fedprox"),
           dict(_FEDSA, partition="pathological", classes_per_client=2),
           {**_FEDSA_SOURCES, "paper": "lines 68-76 (Table 1, pathological CIFAR-10): "
            "FedAvg 90.79, FedProx 90.75, FedSA 91.36"},
           {"fedsa": 91.36, "fedavg": 90.79, "fedprox": 90.75}),
    Preset("fedsa-cifar10-dirichlet",
           "FedSA, Table 1: CIFAR-10, practical setting, Dirichlet alpha 0.1; the "
           "paper reports 90.41 (FedAvg 88.55). Departures as for "
           "fedsa-cifar10-pathological.",
           ("fedsa", "fedavg", "fedprox"),
           dict(_FEDSA, partition="dirichlet", dirichlet_alpha=0.1),
           {**_FEDSA_SOURCES, "paper": "lines 68-76 (Table 1, practical CIFAR-10): "
            "FedAvg 88.55, FedProx 88.94, FedSA 90.41"},
           {"fedsa": 90.41, "fedavg": 88.55, "fedprox": 88.94}),
    Preset("feddwa-cifar10-dirichlet",
           "FedDWA, Table 1: CIFAR-10, dir = 0.3; the paper reports 86.97 (FedAvg "
           "53.44, Ditto 85.41). Eq. 5's softmax has no temperature: 1.",
           ("feddwa", "fedavg"),
           dict(_FEDDWA, partition="dirichlet", dirichlet_alpha=0.3),
           {**_FEDDWA_SOURCES, "paper": "lines 305-316 (Table 1, CIFAR-10 dir = 0.3): "
            "FedAvg 53.44, FedDWA 86.97"},
           {"feddwa": 86.97, "fedavg": 53.44}),
    Preset("feddwa-cifar10-pathological",
           "FedDWA, Table A1: CIFAR-10, 2 classes per client, 20 clients, 100% "
           "participation; the paper reports 85.2 (FedAvg 39.53).",
           ("feddwa", "fedavg"),
           dict(_FEDDWA, partition="pathological", classes_per_client=2),
           {**_FEDDWA_SOURCES, "clients, participation, rounds": _FEDDWA_20_CLIENTS,
            "paper": "lines 217-228 (Table A1, CIFAR-10, 100%): FedAvg 39.53, "
                     "FedDWA 85.2"},
           {"feddwa": 85.2, "fedavg": 39.53}),
    Preset("feddwa-fmnist-pathological",
           "FedDWA, Table A1: Fashion-MNIST, 2 classes per client, 20 clients, 100% "
           "participation; the paper reports 98.75 (FedAvg 75.28). pflax's CNN is "
           "the paper's model (line 158); the train/test ratio is not stated "
           "(75/25).",
           ("feddwa", "fedavg", "fedavg_ft", "ditto", "fedala"),
           dict(_FEDDWA, dataset="fashion_mnist", partition="pathological",
                classes_per_client=2),
           {**_FEDDWA_SOURCES, **_FEDDWA_FMNIST,
            "clients, participation, rounds": _FEDDWA_20_CLIENTS,
            "paper": "lines 217-228 (Table A1, FMNIST, 100%; the cells run together: "
                     "line 219 FedAvg ...75.4475.28, line 228 FedDWA ...98.3998.75, "
                     "20% before 100% as in line 218): FedAvg 75.28, FedDWA 98.75; "
                     "lines 220, 221, 227 (read alike: FedAvg-FT ...98.0698.64, Ditto "
                     "...98.0698.24, FedALA ...98.1298.68): FedAvg-FT 98.64, Ditto "
                     "98.24, FedALA 98.68"},
           {"feddwa": 98.75, "fedavg": 75.28, "fedavg_ft": 98.64, "ditto": 98.24,
            "fedala": 98.68}),
    Preset("feddwa-fmnist-pathological-100-clients",
           "FedDWA, Table A1: Fashion-MNIST, 2 classes per client, 100 clients, 20% "
           "participation; the paper reports 98.39 (FedAvg 75.44). Departures as "
           "for feddwa-fmnist-pathological.",
           ("feddwa", "fedavg", "fedavg_ft", "ditto", "fedala"),
           dict(_FEDDWA, dataset="fashion_mnist", partition="pathological",
                classes_per_client=2, clients=100, participation=0.2, rounds=300),
           {**_FEDDWA_SOURCES, **_FEDDWA_FMNIST,
            "clients, participation, rounds":
                "line 210: when the total number of clients was 100, assuming that "
                "20% of the clients participate in training, the total number of "
                "global communications used for training was 300 times",
            "paper": "lines 217-228 (Table A1, FMNIST, 20%; read as for "
                     "feddwa-fmnist-pathological): FedAvg 75.44, FedDWA 98.39, "
                     "FedAvg-FT 98.06, Ditto 98.06, FedALA 98.12"},
           {"feddwa": 98.39, "fedavg": 75.44, "fedavg_ft": 98.06, "ditto": 98.06,
            "fedala": 98.12}),
    Preset("fedrema-cifar10-groups",
           "FedReMa, Table 1: CIFAR-10, five groups of clients with three dominant "
           "labels, s = 0.2, 600 samples per client split 4:1, 5 seeds; the paper "
           "reports 65.4 ± 0.3% (FedAvg 61.9; FedProx with mu = 1, line 222). "
           "Departures: pflax's CNN instead of a simplified AlexNet; the number of "
           "clients is not stated (20); momentum and clipping from the authors' "
           "code.",
           ("fedrema", "fedavg", "fedprox", "local", "moon", "fedper", "fedbabu"),
           dict(_FEDREMA, dataset="cifar10"),
           {**_FEDREMA_SOURCES,
            "model": "line 220: a simplified AlexNet for CIFAR-10 (pflax: its 4-layer "
                     "CNN)",
            "paper": "lines 234-245 (Table 1, CIFAR-10): Local 58.9, FedAvg 61.9, "
                     "FedProx 61.6, MOON 61.9, FedPer 59.5, FedBABU 53.6, FedReMa "
                     "65.4"},
           {"fedrema": 65.4, "fedavg": 61.9, "fedprox": 61.6, "local": 58.9,
            "moon": 61.9, "fedper": 59.5, "fedbabu": 53.6},
           _FIVE_SEEDS),
    Preset("fedrema-fmnist-groups",
           "FedReMa, Table 1: Fashion-MNIST, five groups of clients with three "
           "dominant labels, s = 0.2, 600 samples per client split 4:1, 5 seeds; "
           "the paper reports 88.2 ± 0.3% (FedAvg 86.1, FedProx with mu = 1 84.8, "
           "Local 86.0). pflax's CNN has the paper's shape (2 convolutional and 2 "
           "fully connected layers, widths not stated). Departures: the number of "
           "clients is not stated (20); momentum and clipping from the authors' "
           "code.",
           ("fedrema", "fedavg", "fedprox", "local", "moon", "fedper", "fedbabu"),
           dict(_FEDREMA, dataset="fashion_mnist"),
           {**_FEDREMA_SOURCES,
            "model": "line 220: For MNIST and FMNIST, we use a CNN model consisting "
                     "of 2 convolutional layers and 2 fully connected layers",
            "paper": "lines 234-245 (Table 1, FMNIST): Local 86.0, FedAvg 86.1, "
                     "FedProx 84.8, MOON 86.0, FedPer 86.1, FedBABU 83.1, FedReMa "
                     "88.2"},
           {"fedrema": 88.2, "fedavg": 86.1, "fedprox": 84.8, "local": 86.0,
            "moon": 86.0, "fedper": 86.1, "fedbabu": 83.1},
           _FIVE_SEEDS),
    _pfllib("pathological", "pathological (2 classes per client)",
            {"fedavg": 80.41, "fedprox": 78.08, "fedper": 99.47, "ditto": 99.44,
             "fedrep": 99.56, "fedbabu": 99.41, "apfl": 99.41, "fedala": 99.57},
            classes_per_client=2),
    _pfllib("dirichlet", "practical (Dir(0.1))",
            {"fedavg": 85.85, "fedprox": 85.63, "fedper": 97.44, "ditto": 97.47,
             "fedrep": 97.56, "fedbabu": 97.46, "apfl": 97.25, "fedala": 97.66},
            dirichlet_alpha=0.1),
)}


class Leaderboard(NamedTuple):
  """A published leaderboard: a few presets, its settings, each algorithm of
  each run with the same seeds.

  Attributes:
    name: what `pflax-run --leaderboard` takes.
    description: what it runs and where its numbers come from.
    source: who published the numbers (the table's column).
    settings: `{setting: preset name}`, in the table's order; each preset's
      `paper` holds the published numbers of its algorithms.
    seeds: the seeds of every (setting, algorithm) sweep (`--seeds` overrides
      them).
  """
  name: str
  description: str
  source: str
  settings: Mapping[str, str]
  seeds: tuple[int, ...]


LEADERBOARDS: dict[str, Leaderboard] = {b.name: b for b in (
    Leaderboard("pfllib-fmnist",
                "PFLlib's Fashion-MNIST leaderboard: each of its baselines that pflax "
                "has, in both settings, 3 seeds, 2,000 rounds; pflax's best "
                "personalized accuracy over the rounds next to PFLlib's.",
                "PFLlib", {"pathological": "pfllib-fmnist-pathological",
                           "dirichlet": "pfllib-fmnist-dirichlet"}, (0, 1, 2)),
)}


def names() -> tuple[str, ...]:
  return tuple(PRESETS)


def get(name: str) -> Preset:
  """The preset `name`; ValueError listing the valid names otherwise."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
  return PRESETS[name]


def leaderboard(name: str) -> Leaderboard:
  """The leaderboard `name`; ValueError listing the valid names otherwise."""
  if name not in LEADERBOARDS:
    raise ValueError(f"unknown leaderboard {name!r}; leaderboards: "
                     f"{', '.join(LEADERBOARDS)}")
  return LEADERBOARDS[name]


def listing() -> str:
  """One block per preset: name, algorithms, seeds, the paper's accuracies,
  description; then one per leaderboard (`--leaderboard`): name, presets, seeds,
  description."""
  blocks = []
  for p in PRESETS.values():
    paper = ", ".join(f"{name} {number:g}" for name, number in p.paper.items())
    blocks.append(f"{p.name}\n  algorithms: {' '.join(p.algorithms)}\n"
                  f"  seeds: {' '.join(map(str, p.seeds))}\n  paper: {paper}\n"
                  f"  {p.description}")
  for b in LEADERBOARDS.values():
    blocks.append(f"--leaderboard {b.name}\n  presets: {' '.join(b.settings.values())}"
                  f"\n  seeds: {' '.join(map(str, b.seeds))}\n  {b.description}")
  return "\n".join(blocks)


def check(preset: Preset, fields: tuple[str, ...]) -> None:
  """Raises ValueError if a preset names a field `ExperimentConfig` lacks."""
  unknown = set(preset.config) - set(fields)
  if unknown:
    raise ValueError(f"preset {preset.name}: unknown fields {sorted(unknown)}")

