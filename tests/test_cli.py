"""`pflax-run`: configuration from flags, --set and --config, one-line errors."""

import copy
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache
import jax.numpy as jnp
import pytest

from pflax import simulate
from pflax._src.cli import config as cli_config
from pflax._src.cli import main as cli
from pflax._src.cli import parser as cli_parser
from pflax._src.cli import runtime
from pflax._src.data import datasets
from pflax._src.simulation import experiment as experiment_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--clients", "6", "--rounds", "2", "--model", "mlp", "--local-epochs", "1",
         "--no-progress", "--no-compilation-cache"]


@pytest.mark.parametrize("flags,message", [
    (["--clients", "0"], "--clients must be >= 1, got 0"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--participation", "0"], r"--participation must be in \(0, 1\], got 0.0"),
    (["--participation", "1.5"], r"--participation must be in \(0, 1\], got 1.5"),
    (["--dirichlet-alpha", "0"], r"--dirichlet-alpha must be a finite number in \(0, "),
    (["--faulty-clients", "1"], r"--faulty-clients must be a fraction in \[0, 1\)"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0, got -1"),
    (["--local-epochs", "0"], "--local-epochs must be >= 1"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--algorithms", "nope"], "algorithm must be one of"),
    (["--set", "wdr"], "--set takes KEY=VALUE"),
    (["--set", "wdr=1"], "--set wdr: unknown key; valid keys: .*cwfedavg.wdr_coef"),
    (["--set", "cwfedavg.wdr_coef=x"], "--set cwfedavg.wdr_coef: 'x' is not a float"),
    (["--set", "fedavg.mu=1", "--algorithms", "fedprox"], "--set fedavg.mu: 'fedavg'"),
    (["--set", "wdr_coef=-1", "--algorithms", "cwfedavg"], "wdr_coef must be a finite"),
    (["--set", "alpha=2", "--algorithms", "feddwa"], "alpha must be a finite number"),
    (["--heterogeneous", "--algorithms", "feddwa"], "--heterogeneous needs algorithms"),
])
def test_bad_flags_are_one_line_errors_before_any_work(flags, message, tmp_path):
  with pytest.raises(SystemExit, match="^pflax-run: " + message) as error:
    cli.main(flags + ["--out", str(tmp_path / "out")])
  assert "\n" not in str(error.value)
  assert not (tmp_path / "out").exists()   # nothing ran, nothing was written


def test_unwritable_out_is_an_error_before_training(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(SystemExit, match="^pflax-run: --out .* cannot be written"):
    cli.main(SMALL + ["--algorithms", "fedavg", "--out", str(blocker / "sub")])


def test_set_reaches_the_builders_and_is_recorded(tmp_path, capsys):
  code = cli.main(["--algorithms", "cwfedavg", "fedclassavg", "--set", "wdr_coef=2",
                   "--set", "fedclassavg.rho=0.5", "--set", "fedclassavg.lr=1e-4",
                   "--print-config", "--out", str(tmp_path)])
  assert code == 0
  config = json.loads(capsys.readouterr().out)
  assert config["hyperparameters"]["cwfedavg"]["wdr_coef"] == 2.0
  assert config["hyperparameters"]["fedclassavg"]["rho"] == 0.5
  assert config["hyperparameters"]["fedclassavg"]["supcon_temperature"] == 100.0
  assert config["optimizers"]["fedclassavg"] == {
      "optimizer": "adam", "lr": 1e-4, "momentum": 0.0, "adam_b1": 0.5,
      "grad_clip": None}
  assert config["optimizers"]["cwfedavg"]["lr"] == 0.05
  assert not list(tmp_path.iterdir())          # --print-config runs nothing


def test_config_file_reruns_the_experiment_and_flags_override_it(tmp_path, capsys):
  out = tmp_path / "first"
  assert cli.main(SMALL + ["--algorithms", "cwfedavg", "--set", "wdr_coef=2",
                           "--seeds", "3", "--out", str(out)]) == 0
  first = json.loads((out / "results.json").read_text())
  capsys.readouterr()
  assert cli.main(["--config", str(out / "results.json"), "--print-config",
                   "--out", str(tmp_path / "x")]) == 0
  assert json.loads(capsys.readouterr().out) == first["config"]
  again = tmp_path / "again"
  assert cli.main(["--config", str(out / "results.json"), "--out", str(again),
                   "--no-progress", "--no-compilation-cache"]) == 0
  rerun = json.loads((again / "results.json").read_text())
  strip = lambda runs: [{k: v for k, v in r.items() if k != "seconds"} for r in runs]
  assert strip(rerun["runs"]) == strip(first["runs"])
  capsys.readouterr()
  assert cli.main(["--config", str(out / "results.json"), "--rounds", "5",
                   "--print-config", "--out", str(tmp_path / "x")]) == 0
  assert json.loads(capsys.readouterr().out)["rounds"] == 5


def _invocation(argv):
  """The parsed arguments of `argv`, a deep copy of them, and their invocation."""
  args = cli_parser.parser().parse_args(argv)
  before = copy.deepcopy(vars(args))
  return args, before, cli_config.invocation_from_args(
      args, cli_parser.given_flags(argv))


def test_the_invocation_layers_preset_config_file_and_flags_without_writing_args(
    tmp_path):
  path = _results(tmp_path / "results.json", algorithms=["fedavg"], seeds=[3, 4],
                  devices=2, sweep={"lr": [0.1, 0.2]}, flower={"engine": "simulation"},
                  rounds=7)
  argv = ["--preset", "cwfedavg-cifar10-pathological", "--config", path,
          "--seeds", "5", "--set", "lr=0.3", "--no-progress"]
  args, before, invocation = _invocation(argv)
  assert vars(args) == before                 # args is only read
  assert invocation.algorithms == ("fedavg",)  # the file's, over the preset's
  assert invocation.seeds == (5,)              # the flag's, over the file's
  assert (invocation.devices, invocation.flower) == (2, "simulation")
  assert (invocation.sweep, invocation.values) == ("lr", (0.1, 0.2))
  assert invocation.config.rounds == 7 and invocation.config.dataset == "cifar10"
  assert invocation.config.optimizers["fedavg"]["lr"] == 0.3
  assert invocation.preset == "cwfedavg-cifar10-pathological"
  assert not invocation.progress and invocation.compilation_cache
  assert invocation.tune == ()
  with pytest.raises(dataclasses.FrozenInstanceError):
    invocation.seeds = (0,)


def test_a_preset_gives_algorithms_and_seeds_unless_flags_do():
  name = "cwfedavg-cifar10-pathological"
  args, before, invocation = _invocation(["--preset", name])
  assert vars(args) == before and args.algorithms == list(
      cli_parser.parser().parse_args([]).algorithms)
  assert invocation.algorithms == ("cwfedavg", "fedavg", "fedprox")
  args, before, invocation = _invocation(["--preset", name, "--algorithms", "local",
                                          "--seeds", "1", "2"])
  assert vars(args) == before
  assert invocation.algorithms == ("local",) and invocation.seeds == (1, 2)


def test_config_file_with_unknown_keys_is_refused(tmp_path):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({"config": {"clients": 6, "learning_rate": 0.1}}))
  with pytest.raises(SystemExit, match="unknown keys learning_rate"):
    cli.main(["--config", str(path), "--out", str(tmp_path)])


def test_ctrl_c_is_one_line(monkeypatch, tmp_path, capsys):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(simulate, "prepare", interrupted)
  monkeypatch.setattr(experiment_lib, "prepare", interrupted)
  assert cli.main(SMALL + ["--algorithms", "fedavg", "--out", str(tmp_path)]) == 130
  assert capsys.readouterr().err.strip() == "pflax-run: interrupted"


def test_help_shows_every_default():
  out = subprocess.run([sys.executable, "-m", "pflax", "--help"], capture_output=True,
                       text=True, check=True, cwd=REPO).stdout
  assert "(default: 20)" in out and "(default: 0.05)" in out
  assert "(default: pathological)" in out and "(default: runs/latest)" in out


def test_persistent_compilation_cache_fills_and_can_be_turned_off(tmp_path):
  env = dict(os.environ, PFLAX_CACHE_DIR=str(tmp_path / "cache"))
  command = [sys.executable, "-m", "pflax", "--algorithms", "fedavg", *SMALL[:-1]]
  subprocess.run(command + ["--out", str(tmp_path / "a")], env=env, check=True,
                 capture_output=True, cwd=REPO)
  assert len(os.listdir(tmp_path / "cache")) > 0
  (tmp_path / "tmp").mkdir()
  off = dict(env, PFLAX_CACHE_DIR=str(tmp_path / "off"), TMPDIR=str(tmp_path / "tmp"))
  subprocess.run(command + ["--out", str(tmp_path / "b"), "--no-compilation-cache"],
                 env=off, check=True, capture_output=True, cwd=REPO)
  assert not (tmp_path / "off").exists()
  assert not os.listdir(tmp_path / "tmp")   # the run's own cache is removed


def test_without_the_persistent_cache_identical_programs_compile_once(
    tmp_path, monkeypatch):
  """`--no-compilation-cache`'s cache of the run: a second function with the
  same program is read from it; it is removed, and no cache left configured."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  monkeypatch.setattr(runtime, "CACHE_MIN_COMPILE_SECONDS", 0.0)
  configured = jax.config.jax_compilation_cache_dir   # the tests' own (conftest)
  threshold = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_compilation_cache_dir", None)
  jax_cache.reset_cache()
  hits = []
  listener = lambda event, **kw: hits.append(event)
  jax.monitoring.register_event_listener(listener)
  try:
    x = jnp.arange(7.0)
    with runtime.run_compilation_cache():
      folder = jax.config.jax_compilation_cache_dir
      assert os.path.dirname(folder) == str(tmp_path)
      jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.0)(x).block_until_ready()
      entries = len(os.listdir(folder))
      assert entries > 0 and not _cache_hits(hits)
      jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.0)(x).block_until_ready()
      assert _cache_hits(hits) == 1 and len(os.listdir(folder)) == entries
    assert not os.path.exists(folder)
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == threshold
  finally:
    jax.monitoring.unregister_event_listener(listener)
    jax.config.update("jax_compilation_cache_dir", configured)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    jax_cache.reset_cache()


def _cache_hits(events: list[str]) -> int:
  return sum(event == "/jax/compilation_cache/cache_hits" for event in events)


def test_a_killed_runs_cache_folder_is_removed_by_the_next_run(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  host = socket.gethostname()
  dead = tmp_path / f"{runtime.RUN_CACHE_PREFIX}{gone.stdout.strip()}@{host}@abc"
  live = tmp_path / f"{runtime.RUN_CACHE_PREFIX}{os.getpid()}@{host}@def"
  elsewhere = tmp_path / f"{runtime.RUN_CACHE_PREFIX}{gone.stdout.strip()}@not-{host}@gh"
  other = tmp_path / f"{runtime.RUN_CACHE_PREFIX}notapid"
  for folder in (dead, live, elsewhere, other):
    folder.mkdir()
    (folder / "entry").write_bytes(b"x")
  configured = jax.config.jax_compilation_cache_dir   # the tests' own (conftest)
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    with runtime.run_compilation_cache():
      own = jax.config.jax_compilation_cache_dir
      assert os.path.basename(own).startswith(
          f"{runtime.RUN_CACHE_PREFIX}{os.getpid()}@{host}@")
      assert not dead.exists()
      assert live.exists() and elsewhere.exists() and other.exists()
  finally:
    jax.config.update("jax_compilation_cache_dir", configured)
    jax_cache.reset_cache()
  assert not os.path.exists(own)


def test_a_configured_cache_is_left_as_it_is():
  configured = jax.config.jax_compilation_cache_dir
  assert configured   # the tests' own (conftest)
  with runtime.run_compilation_cache():
    assert jax.config.jax_compilation_cache_dir == configured
  assert jax.config.jax_compilation_cache_dir == configured


def test_download_flag_asks_tfds_to_prepare_first(monkeypatch, tmp_path):
  calls = []

  def load(name, *, data_dir=None, download=False):
    calls.append((name, data_dir, download))
    raise KeyboardInterrupt   # stop before training
  monkeypatch.setattr(datasets, "load", load)
  assert cli.main(SMALL + ["--dataset", "mnist", "--data-dir", str(tmp_path),
                           "--download", "--out", str(tmp_path / "out")]) == 130
  assert calls == [("mnist", str(tmp_path), True)]


def test_without_download_a_missing_dataset_fails_fast(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  with pytest.raises(SystemExit, match="^pflax-run: (?s:.*)--download"):
    cli.main(SMALL + ["--dataset", "mnist", "--data-dir", str(tmp_path),
                      "--out", str(tmp_path / "out")])


# --config never imports; the current folder is never first on the path.

def _planted(folder, name):
  """`folder/name.py`, a module that writes `folder/name.imported` when imported
  (and exports the FedAvg builder as `fedx`)."""
  marker = folder / f"{name}.imported"
  (folder / f"{name}.py").write_text(
      f"open({str(marker)!r}, 'w').close()\n"
      "from pflax.algorithms import fedavg as fedx\n")
  return marker


@pytest.fixture
def planted(tmp_path, monkeypatch):
  """The current folder is `tmp_path`, importable, and holds `evil.py`; sys.path
  is restored and `evil` forgotten afterwards."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
  yield _planted(tmp_path, "evil")
  sys.modules.pop("evil", None)


def _results(path, **config):
  path.write_text(json.dumps({"config": config, "runs": []}))
  return str(path)


@pytest.mark.parametrize("print_config", [[], ["--print-config"]])
def test_a_config_file_naming_a_module_imports_nothing(planted, tmp_path,
                                                      print_config):
  path = _results(tmp_path / "results.json", algorithms=["evil:fedx"],
                  hyperparameters={"evil:fedx": {}})
  with pytest.raises(SystemExit) as error:
    cli.main(["--config", path, "--out", str(tmp_path / "out"), *print_config])
  assert str(error.value) == ("pflax-run: --config names the algorithm 'evil:fedx' "
                              "(a module to import); give it with --algorithms to "
                              "run it")
  assert not planted.exists() and "evil" not in sys.modules


def test_a_config_files_settings_for_a_module_not_run_are_left_out(planted, tmp_path,
                                                                  capsys):
  path = _results(tmp_path / "results.json", algorithms=["fedavg"],
                  hyperparameters={"evil:fedx": {"x": 1}},
                  optimizers={"evil:fedx": {"lr": 1.0}})
  for flags in ([], ["--algorithms", "fedprox"]):
    assert cli.main(["--config", path, "--print-config", *flags]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "evil:fedx" not in printed["hyperparameters"]
  assert not planted.exists() and "evil" not in sys.modules


def test_a_module_builder_given_on_the_command_line_runs_from_the_current_folder(
    planted, tmp_path, capsys):
  sys.path.remove(str(tmp_path))        # as under pflax-run: not on the path
  path = _results(tmp_path / "results.json", algorithms=["evil:fedx"],
                  hyperparameters={"evil:fedx": {}})
  assert cli.main(["--config", path, "--algorithms", "evil:fedx",
                   "--print-config"]) == 0
  assert planted.exists() and sys.path[-1] == str(tmp_path)
  assert json.loads(capsys.readouterr().out)["algorithms"] == ["evil:fedx"]


def test_without_a_module_builder_the_current_folder_is_not_on_the_path(
    tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  assert cli.main(["--algorithms", "fedavg", "--print-config"]) == 0
  capsys.readouterr()
  assert str(tmp_path) not in sys.path


def _pflax_run(tmp_path, *flags):
  """`pflax-run FLAGS` in a subprocess whose current folder is `tmp_path/work`,
  started as the console script is (its own folder first on the path, not the
  current one)."""
  script = tmp_path / "bin" / "pflax_run.py"
  script.parent.mkdir(exist_ok=True)
  script.write_text("import sys\nfrom pflax._src.cli.main import main\nsys.exit(main())\n")
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, str(script), *flags], cwd=tmp_path / "work",
                        env=env, capture_output=True, text=True, check=False)


def test_pflax_run_print_config_imports_nothing_from_the_current_folder(tmp_path):
  (tmp_path / "work").mkdir()
  markers = [_planted(tmp_path / "work", name) for name in ("tqdm", "evil")]
  _results(tmp_path / "work" / "results.json", algorithms=["evil:fedx"])
  done = _pflax_run(tmp_path, "--print-config")
  assert done.returncode == 0, done.stderr
  done = _pflax_run(tmp_path, "--config", "results.json", "--print-config")
  assert done.stderr.strip() == ("pflax-run: --config names the algorithm "
                                 "'evil:fedx' (a module to import); give it with "
                                 "--algorithms to run it")
  assert not any(marker.exists() for marker in markers)


@pytest.mark.slow
def test_pflax_run_trains_with_the_installed_tqdm_not_the_current_folders(tmp_path):
  """A run imports tqdm (the progress bar) after `--algorithms module:builder` put
  the current folder on the path: the installed one, not `tqdm.py` there."""
  (tmp_path / "work").mkdir()
  tqdm = _planted(tmp_path / "work", "tqdm")
  builder = _planted(tmp_path / "work", "mine")
  done = _pflax_run(tmp_path, *SMALL, "--clients", "2", "--rounds", "1",
                    "--algorithms", "mine:fedx", "--out", "out")
  assert done.returncode == 0, done.stderr
  assert builder.exists() and not tqdm.exists()
