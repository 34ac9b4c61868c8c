"""A misconfigured experiment is an error naming the setting (a warning where the
setting is legitimate), before anything is compiled; in `pflax-run`, one line."""

import dataclasses
import json
import re
import warnings

import numpy as np
import pytest

from pflax import data
from pflax import simulate
from pflax._src.cli import main as cli
from pflax._src.data import datasets
from pflax._src.simulation import experiment as experiment_lib
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import simulate as simulate_lib
from pflax._src.simulation import tune as tune_lib

CONFIG = simulate.ExperimentConfig(clients=6, rounds=1, model="mlp", local_epochs=1)
QUIET = ["--no-progress", "--no-compilation-cache"]


def _one_line_exit(argv, match):
  """The message of the `SystemExit` of `pflax-run argv`: one line matching."""
  with pytest.raises(SystemExit, match="^pflax-run: " + match) as error:
    cli.main(argv)
  assert "\n" not in str(error.value)
  return str(error.value)


def _config_file(tmp_path, **config):
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"config": {"clients": 6, "rounds": 1, **config}}))
  return str(path)


# 1. A key of hyperparameters / optimizers that names no algorithm.

@pytest.mark.parametrize("table", ["hyperparameters", "optimizers"])
def test_a_misspelt_algorithm_key_is_refused_before_any_work(table):
  config = dataclasses.replace(CONFIG, **{table: {"cwfedav": {"lr": 0.1}}})
  with pytest.raises(ValueError, match=rf"^{table}: unknown algorithm 'cwfedav' "
                     r"\(did you mean 'cwfedavg'\?\); known: local, fedavg"):
    simulate.sweep("cwfedavg", config, [0])


def test_keys_of_built_in_algorithms_not_run_and_of_the_run_builder_are_accepted():
  def my_builder(model, optimizer, *, strength=1.0):
    return experiment_lib.resolve_builder("fedavg")(model, optimizer)
  config = dataclasses.replace(CONFIG, hyperparameters={
      "fedprox": {"mu": 0.1}, "my_builder": {"strength": 2.0}})
  experiment_lib.check_algorithm(my_builder, config)
  experiment_lib.check_algorithm_keys(config, ["fedavg", my_builder])
  with pytest.raises(ValueError, match="unknown algorithm 'my_builder'"):
    experiment_lib.check_algorithm_keys(config, ["fedavg"])
  with pytest.raises(ValueError, match=r"hyperparameters\['my_builder'\]: unknown "
                     r"keyword 'strenght' \(did you mean 'strength'\?\)"):
    experiment_lib.check_algorithm(my_builder, dataclasses.replace(
        config, hyperparameters={"my_builder": {"strenght": 2.0}}))


def test_a_module_builder_key_must_import():
  config = dataclasses.replace(CONFIG, hyperparameters={"no_such_module:build": {}})
  with pytest.raises(ValueError, match="^hyperparameters: unknown algorithm "
                     "'no_such_module:build': cannot import"):
    experiment_lib.check_algorithm("fedavg", config)


def test_cli_config_file_with_a_misspelt_algorithm_is_one_line(tmp_path):
  path = _config_file(tmp_path, algorithms=["cwfedavg"],
                      hyperparameters={"cwfedav": {"wdr_coef": 2.0}})
  _one_line_exit(["--config", path, "--out", str(tmp_path / "out")],
                 r"hyperparameters: unknown algorithm 'cwfedav' \(did you mean "
                 r"'cwfedavg'\?\)")
  assert not (tmp_path / "out").exists()


# 1b. A keyword that the algorithm's builder (or the optimizer) does not take.

@pytest.mark.parametrize("config,message", [
    (dict(hyperparameters={"cwfedavg": {"wdr": 2.0}}),
     r"hyperparameters\['cwfedavg'\]: unknown keyword 'wdr' \(did you mean "
     r"'wdr_coef'\?\); cwfedavg's builder takes wdr_coef, "),
    (dict(hyperparameters={"fedavg": {"mu": 0.1}}),
     r"hyperparameters\['fedavg'\]: unknown keyword 'mu'; fedavg's builder takes "
     r"robust, trim_fraction, max_share, clip_norm, num_byzantine, radius\."),
    (dict(hyperparameters={"fedavg": {"lr": 0.1}}),
     r"hyperparameters\['fedavg'\]: 'lr' is a field of the clients' optimizer: set it "
     r"in optimizers\['fedavg'\]\."),
    (dict(optimizers={"fedavg": {"learning_rate": 0.1}}),
     r"optimizers\['fedavg'\]: unknown keyword 'learning_rate'; the optimizer takes "
     r"optimizer, lr, momentum, adam_b1, grad_clip\."),
])
def test_an_unknown_keyword_of_an_entry_is_refused(config, message):
  with pytest.raises(ValueError, match="^" + message):
    simulate.sweep("fedavg", dataclasses.replace(CONFIG, **config), [0])


def test_cli_config_file_with_an_unknown_keyword_is_one_line(tmp_path):
  path = _config_file(tmp_path, algorithms=["fedsa"],
                      hyperparameters={"fedsa": {"cv_treshold": 0.3}})
  _one_line_exit(["--config", path, "--out", str(tmp_path / "out")],
                 r"hyperparameters\['fedsa'\]: unknown keyword 'cv_treshold' \(did "
                 r"you mean 'cv_threshold'\?\)")


# 2. A prepared setup whose federation does not have config.clients clients.

def test_a_setup_of_another_client_count_is_refused_before_compiling(monkeypatch):
  setup = simulate.prepare(dataclasses.replace(CONFIG, clients=10), 0)
  monkeypatch.setattr(simulate_lib.engine, "programs", None)  # never reached
  with pytest.raises(ValueError, match=r"^setup: the federation of seed 0 has 10 "
                     r"clients, config.clients is 20\."):
    simulate.run("fedavg", dataclasses.replace(CONFIG, clients=20), 0, setup=setup)


# 3. Participation that rounds to another number of clients; clients vs data.

def test_participation_that_rounds_away_warns():
  config = dataclasses.replace(CONFIG, clients=20, participation=0.01)
  with pytest.warns(UserWarning, match="^participation 0.01 of 20 clients is 0.2 "
                    "clients; 1 client takes part each round$"):
    experiment_lib.warn_participation(config)
  assert experiment_lib.participation_warning(
      dataclasses.replace(config, participation=0.3, clients=5)) == (
          "participation 0.3 of 5 clients is 1.5 clients; 2 clients take part each "
          "round")
  for participation, clients in ((0.1, 20), (1.0, 7), (0.33, 20), (0.05, 20)):
    assert experiment_lib.participation_warning(dataclasses.replace(
        config, participation=participation, clients=clients)) is None


def test_cli_participation_warning_is_one_line(tmp_path, capsys):
  assert cli.main(["--participation", "0.01", "--print-config",
                   "--out", str(tmp_path)]) == 0
  err = capsys.readouterr().err.strip()
  assert err == ("pflax-run: warning: --participation 0.01 of 20 clients is 0.2 "
                 "clients; 1 client takes part each round")


def test_more_clients_than_a_batch_of_data_each_warns():
  config = dataclasses.replace(CONFIG, clients=500)
  with pytest.warns(UserWarning) as caught:
    setup = simulate.prepare(config, 0)
  messages = [str(w.message) for w in caught]
  assert messages[0].startswith(
      "clients: 500 of 500 clients have fewer training samples than batch_size 10 "
      "(the fewest: ")
  assert "fill one batch for at most 100 clients" in messages[0]
  untested = int(np.sum(setup.federation.test_mask.sum(axis=1) == 0))
  assert untested > 0 and messages[1] == (
      f"clients: {untested} of 500 clients have no test sample; their accuracy is not "
      "measured (left out of the per-client mean and std).")


def test_cli_shows_the_data_warnings_as_one_line_each(monkeypatch, tmp_path, capsys):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt   # stop before training
  monkeypatch.setattr(simulate_lib, "sweep", interrupted)
  assert cli.main(["--clients", "500", "--algorithms", "fedavg", *QUIET,
                   "--out", str(tmp_path)]) == 130
  err = capsys.readouterr().err.splitlines()
  assert err[0].startswith("pflax-run: warning: --clients: 500 of 500 clients have "
                           "fewer training samples than batch_size 10")
  assert err[1].startswith("pflax-run: warning: --clients: ")
  assert "no test sample" in err[1] and err[2] == "pflax-run: interrupted"


def test_more_clients_than_samples_is_an_error():
  with pytest.raises(ValueError, match=r"^clients must be <= the dataset's 1797 "
                     r"samples, got 2000\."):
    simulate.prepare(dataclasses.replace(CONFIG, clients=2000), 0)


def test_cli_more_clients_than_samples_is_one_line(tmp_path):
  _one_line_exit(["--clients", "2000", "--partition", "dirichlet",
                  "--out", str(tmp_path)],
                 "--clients must be <= the dataset's 1797 samples, got 2000")


def test_pathological_classes_too_small_to_share_names_the_largest_client_count():
  message = (r"^clients: 871 clients of 2 classes each share a class among up to "
             r"175 clients, but class 8 has 174 samples; use at most 870 clients\.")
  with pytest.raises(ValueError, match=message):
    simulate.prepare(dataclasses.replace(CONFIG, clients=871), 0)
  with pytest.warns(UserWarning):
    simulate.prepare(dataclasses.replace(CONFIG, clients=870), 0)


def test_a_client_without_training_samples_is_an_error():
  labels = np.repeat(np.arange(2), 4)
  part = data.pathological(labels, 2, 1, num_classes=2, seed=0)
  fed = data.federate(np.zeros((8, 3), np.float32), labels, part, seed=0)
  empty = fed._replace(num_samples=np.array([fed.num_samples[0], 0]))
  with pytest.raises(ValueError, match=r"^clients: 2 clients on \d+ samples leave 1 "
                     r"of them without a training sample; use at most \d+ clients\."):
    experiment_lib.check_partition(dataclasses.replace(CONFIG, clients=2), empty)


def test_too_many_classes_per_client_is_an_error():
  with pytest.raises(ValueError, match=r"^classes_per_client must be <= the "
                     r"dataset's 10 classes, got 11\."):
    simulate.prepare(dataclasses.replace(CONFIG, classes_per_client=11), 0)


def test_cli_too_many_classes_per_client_is_one_line(tmp_path):
  _one_line_exit(["--classes-per-client", "11", "--out", str(tmp_path / "out")],
                 "--classes-per-client must be <= the dataset's 10 classes, got 11")


# 3b. A configuration checks itself (issue 33): every ExperimentConfig, however
# made, is valid or a ValueError naming the field, the range and the value; the
# participation warning is about a run: once where it starts, never at construction.

_FAULT_KINDS = faults_lib.FAULT_KINDS
BAD_FIELDS = [
    (dict(clients=0), "clients must be >= 1, got 0."),
    (dict(clients="6"), "clients must be an integer, got '6'."),
    (dict(clients=True), "clients must be an integer, got True."),
    (dict(clients=2.5), "clients must be an integer, got 2.5."),
    (dict(rounds=10**7), "rounds must be at most 1000000, got 10000000."),
    (dict(eval_every=0), "eval_every must be >= 1, got 0."),
    (dict(lr=float("nan")), "lr must be a finite number, got nan."),
    (dict(lr=1e30), "lr must be a finite number in (0.0, 1000.0], got 1e+30."),
    (dict(momentum=1.0), "momentum must be a finite number in [0.0, 0.999], got 1.0."),
    (dict(grad_clip=0.0), "grad_clip must be a finite number in (0.0, 1000.0], got "
                          "0.0."),
    (dict(optimizer="rmsprop"), "optimizer must be 'sgd' or 'adam', got 'rmsprop'."),
    (dict(participation=0.0), "participation must be in (0, 1], got 0.0."),
    (dict(participation=None), "participation must be a finite number, got None."),
    (dict(test_split="test"), "test_split must be one of ('clients', 'dataset'), got "
                              "'test'."),
    (dict(fault_kind="flip"), f"fault_kind must be one of {_FAULT_KINDS}, got 'flip'."),
    (dict(fault_scale=0.0), "fault_scale must be None or a non-zero number of "
                            "magnitude at most 1e+30, got 0.0."),
    (dict(faulty_clients=1.0), "faulty_clients must be a fraction in [0, 1), got 1.0."),
    (dict(dp_delta=1.0), "dp_delta must be in (0, 1), got 1.0."),
    (dict(dp_clip=1.0, heterogeneous=True, family="mlp"),
     "heterogeneous must be False under client-level DP (dp_clip), got True."),
    (dict(heterogeneous="yes"), "heterogeneous must be True or False, got 'yes'."),
    (dict(family="mlp"), 'family must be "cnn" (the default) unless '
                         "heterogeneous=True: it names the heterogeneous clients' "
                         "architectures, got 'mlp'."),
    (dict(model="resnet"), "model must be one of ('auto', 'cnn', 'mlp'), got "
                           "'resnet'."),
    (dict(precision="fp16"), "precision must be one of ('float32', 'bf16'), got "
                             "'fp16'."),
    (dict(data_dir=""), "data_dir must be None or a folder, got ''."),
    (dict(dataset=None), "dataset must be a string, got None."),
]


@pytest.mark.parametrize("fields,message", BAD_FIELDS, ids=repr)
def test_a_config_with_a_bad_value_is_refused_at_construction(fields, message):
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    simulate.ExperimentConfig(**fields)


@pytest.mark.parametrize("fields,message", BAD_FIELDS[:6], ids=repr)
def test_replace_with_a_bad_value_is_refused(fields, message):
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    dataclasses.replace(CONFIG, **fields)


def test_a_config_round_trips_through_json_and_a_bad_value_is_refused_on_load():
  config = dataclasses.replace(CONFIG, participation=0.5, dp_clip=1.0,
                               dp_noise_multiplier=1.0,
                               hyperparameters={"fedprox": {"mu": 0.1}})
  saved = json.loads(json.dumps(dataclasses.asdict(config)))
  assert simulate.ExperimentConfig(**saved) == config
  with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got -3\.$"):
    simulate.ExperimentConfig(**{**saved, "batch_size": -3})


def test_a_flower_experiment_round_trips_and_a_bad_config_is_refused_on_load():
  pytest.importorskip("flwr")
  from pflax import flower  # pylint: disable=import-outside-toplevel
  experiment = flower.Experiment("fedprox", dataclasses.replace(
      CONFIG, hyperparameters={"fedprox": {"mu": 0.1}}), 3)
  assert flower.Experiment.from_json(experiment.to_json()) == experiment
  text = experiment.to_json().replace('"rounds": 1', '"rounds": 0')
  with pytest.raises(ValueError, match=r"^rounds must be >= 1, got 0\.$"):
    flower.Experiment.from_json(text)


ROUNDING = "participation 0.1 of 6 clients is 0.6 clients; 1 client takes part each round"


def _participation_warnings(caught):
  return [w for w in caught if issubclass(w.category, UserWarning)
          and str(w.message) == ROUNDING]


def test_the_participation_warning_is_not_given_at_construction():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    config = dataclasses.replace(CONFIG, participation=0.1)
    dataclasses.replace(config, rounds=2)
    simulate.ExperimentConfig(clients=6, participation=0.1)
  assert experiment_lib.participation_warning(config) == ROUNDING
  assert not _participation_warnings(caught)


def _strategy(config):
  pytest.importorskip("flwr")
  from pflax import flower  # pylint: disable=import-outside-toplevel
  return flower.PflaxStrategy(flower.Experiment("fedavg", config))


@pytest.mark.parametrize("start", [
    lambda config: simulate.run("fedavg", config, 0),
    lambda config: simulate.sweep("fedavg", config, [0, 1]),
    lambda config: tune_lib.make_task("fedavg", config, ["lr"]),
    _strategy,
], ids=["run", "sweep", "make_task", "flower"])
def test_the_participation_warning_is_given_once_per_run(start):
  config = dataclasses.replace(CONFIG, participation=0.1)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start(config)
  assert len(_participation_warnings(caught)) == 1


# 4. Data that cannot be loaded: one message, no traceback.

@pytest.mark.parametrize("error", [FileNotFoundError, ImportError, ValueError])
def test_cli_data_errors_end_as_pflax_run_messages(monkeypatch, tmp_path, error):
  def load(name, *, data_dir=None, download=False):
    raise error(f"cannot load {name}:\n  see --download")
  monkeypatch.setattr(datasets, "load", load)
  with pytest.raises(SystemExit) as exit_:
    cli.main(["--dataset", "mnist", "--download", *QUIET, "--out", str(tmp_path)])
  assert str(exit_.value) == "pflax-run: cannot load mnist:\n  see --download"


# The architecture family of heterogeneous clients.

def test_a_family_without_heterogeneous_clients_is_an_error():
  with pytest.raises(ValueError, match=r'^family must be "cnn" \(the default\) unless '
                                       r"heterogeneous=True"):
    simulate.run("fedclassavg", dataclasses.replace(CONFIG, family="mlp"), 0)


def test_an_unknown_family_is_an_error():
  with pytest.raises(ValueError, match=r"^family must be one of \('cnn', 'mlp'\), "
                                       "got 'resnet'"):
    simulate.run("fedclassavg", dataclasses.replace(CONFIG, heterogeneous=True,
                                                    family="resnet"), 0)


def test_cli_unknown_family_is_refused(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--heterogeneous", "--family", "resnet", *QUIET])
  assert "invalid choice: 'resnet'" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["cnn", "mlp"])
def test_heterogeneous_clients_get_the_family_named(family):
  config = dataclasses.replace(CONFIG, clients=8, heterogeneous=True, family=family)
  setup = simulate.prepare(config, 0)
  plan = experiment_lib.plan("fedavg", config, setup, config.clients, "auto", None)
  assert plan.build(None).models == experiment_lib.models.FAMILIES[family](
      setup.num_classes)


# 9. Absurd but well-formed values (issue 34): every flag and --config value out of
# its range is a one-line error before any work, never a traceback or a run.

_NAN, _INF = float("nan"), float("inf")
BAD_FLAGS = [
    ["--lr", "1e30"], ["--lr", "nan"], ["--lr", "inf"], ["--lr", "0"],
    ["--grad-clip", "nan"], ["--grad-clip", "0"], ["--grad-clip", "-1"],
    ["--grad-clip", "inf"], ["--momentum", "-1"], ["--momentum", "nan"],
    ["--momentum", "1"], ["--adam-b1", "1"], ["--adam-b1", "-0.1"],
    ["--adam-b1", "nan"], ["--fault-scale", "0"], ["--fault-scale", "nan"],
    ["--fault-scale", "1e300"], ["--fault-kind", "inflated_counts", "--fault-scale",
                                 "-2"],
    ["--outlier-factor", "nan"], ["--outlier-factor", "inf"],
    ["--outlier-factor", "-1"], ["--iid-fraction", "nan"], ["--test-fraction", "nan"],
    ["--participation", "nan"], ["--faulty-clients", "nan"],
    ["--dirichlet-alpha", "1e300"], ["--dirichlet-alpha", "nan"],
    ["--clients", "100000000"], ["--rounds", "10000000000"],
    ["--batch-size", "100000000"], ["--local-epochs", "1000000000"],
    ["--eval-every", "0"], ["--samples-per-client", "0"],
    ["--classes-per-client", "1000"], ["--seeds", "-1"], ["--seeds", "99999999999"],
    ["--devices", "0"], ["--checkpoint-every", "-5"],
    ["--flower", "--flower-timeout", "nan"], ["--flower", "--flower-timeout", "inf"],
    ["--tune", "lr", "--tune-lr", "nan"], ["--tune", "lr", "--tune-lr", "inf"],
    ["--tune", "lr", "--tune-steps", "-1"], ["--tune", "lr", "--tune-validation", "nan"],
    ["--sweep", "lr", "--values", "nan"], ["--sweep", "lr", "--values", "1e30"],
    ["--sweep", "lr", "--values", "-1"], ["--sweep", "lr", "--values", "0"],
    ["--algorithms", "fedprox", "--sweep", "mu", "--values", "1e30"],
    ["--algorithms", "fedavg", "--set", "fedavg.lr=1e30"],
    ["--algorithms", "fedavg", "--set", "fedavg.lr=nan"],
    ["--algorithms", "fedavg", "--set", "fedavg.grad_clip=nan"],
    ["--algorithms", "fedavg", "--set", "fedavg.momentum=nan"],
    ["--algorithms", "fedprox", "--set", "mu=nan"],
    ["--algorithms", "fedprox", "--set", "mu=-1"],
    ["--algorithms", "fedprox", "--set", "mu=1e30"],
    ["--algorithms", "cwfedavg", "--set", "wdr_coef=inf"],
    ["--algorithms", "fedclassavg", "--set", "rho=nan"],
    ["--algorithms", "fedclassavg", "--set", "fedclassavg.lr=inf"],
    ["--algorithms", "fedclassavg", "--set", "fedclassavg.adam_b1=2"],
]
BAD_CONFIGS = [
    dict(clients="6"), dict(clients=2.5), dict(clients=None), dict(clients=True),
    dict(clients=[1]), dict(clients=10**9), dict(lr="0.1"), dict(lr=None), dict(lr=[0.1]),
    dict(lr=_INF), dict(lr=_NAN), dict(lr=1e30), dict(grad_clip=_NAN),
    dict(grad_clip="1"), dict(momentum=1.0), dict(rounds=1.5), dict(rounds="x"),
    dict(eval_every=10**30), dict(partition=5), dict(partition="nope"),
    dict(dataset=5), dict(dataset=None), dict(data_dir=5), dict(model="resnet"),
    dict(strategy="gpu"), dict(optimizer="rmsprop"), dict(fault_kind=3),
    dict(fault_scale=1e300), dict(test_split=None), dict(heterogeneous="yes"),
    dict(samples_per_client=1.5), dict(batch_size=-3), dict(iid_fraction="0.2"),
    dict(participation=None), dict(classes_per_client=0.5),
    dict(optimizers={"fedavg": {"lr": 1e30}}), dict(optimizers={"fedavg": {"lr": "x"}}),
    dict(optimizers={"fedavg": {"optimizer": "rmsprop"}}), dict(optimizers={"fedavg": 5}),
    dict(optimizers=[1]), dict(hyperparameters=5),
    dict(hyperparameters={"fedprox": {"mu": "x"}}, algorithms=["fedprox"]),
    dict(hyperparameters={"fedprox": {"mu": None}}, algorithms=["fedprox"]),
    dict(hyperparameters={"fedprox": {"mu": 1e30}}, algorithms=["fedprox"]),
    dict(algorithms="fedavg"), dict(algorithms=[]), dict(algorithms=[5]),
    dict(seeds=[-1]), dict(seeds="0"), dict(seeds=[0.5]), dict(seeds=[]),
    dict(devices=0), dict(devices="x"), dict(sweep={"lr": "x"}),
    dict(sweep={"lr": [1, 2], "mu": [1]}), dict(sweep=5), dict(sweep={"lr": [_NAN]}),
    dict(flower={"x": 1}), dict(flower="deployment"),
]


@pytest.fixture
def no_work(monkeypatch):
  """Fails the test if `pflax-run` gets past its checks to any run."""
  from pflax._src.cli import federation as cli_federation  # pylint: disable=import-outside-toplevel
  from pflax._src.cli import runs as cli_runs  # pylint: disable=import-outside-toplevel
  def ran(*args, **kwargs):
    raise AssertionError("a bad value was accepted: the run started")
  for module, name in ((cli_runs, "simulate_all"), (cli_runs, "tune"),
                       (cli_federation, "federate")):
    monkeypatch.setattr(module, name, ran)


def _refused(argv):
  with pytest.raises(SystemExit) as error:
    cli.main(argv)
  message = str(error.value.code)
  assert message.startswith("pflax-run: ") and "\n" not in message, message
  assert error.value.code not in (0, None)


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=" ".join)
def test_absurd_flags_are_one_line_errors_before_work(flags, tmp_path, no_work):
  _refused(QUIET + flags + ["--out", str(tmp_path / "out")])


@pytest.mark.parametrize("config", BAD_CONFIGS, ids=repr)
def test_absurd_config_files_are_one_line_errors_before_work(config, tmp_path,
                                                              no_work):
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"config": config}))
  _refused(QUIET + ["--config", str(path), "--out", str(tmp_path / "out")])
