"""One GPU benchmark: training, aggregators, main job, leaderboard slice, runs.

Writes `benchmarks/results/gpu.md` (or `--out`): the device, its driver, the
versions of jax, jaxlib, flax and torch, five sections and the targets, every
time measured in this run, every ratio against a baseline measured in the same
run:

  training      samples/s of one round of local training (100 samples per
                client, batches of 10, one epoch of SGD at lr 0.01), for the
                MNIST CNN and the MLP at M = 20, 100 and 1,000 clients:
                  plain vmap   the reference (`plain_vmap`): stacked
                               parameters, batches laid out `(S, M, B, ...)`
                               beforehand, `lax.scan` over the S steps of
                               `jax.vmap(jax.grad(loss))`, SGD by `tree.map`;
                  pflax vmap   `make_trainer(strategy="vmap")`, today's trainer
                               on accelerators (per-client order, masks, keys);
                  pflax steps  `make_trainer(strategy="steps")`, the candidate:
                               the same results, batches gathered before the loop;
                  pflax steps bf16  the same with `precision="bf16"`;
                  pflax auto   the default strategy, where it is not "vmap" (CPU);
                  fused        the ceiling: one model on batches of M x B;
                  torch        a PFLlib-style PyTorch loop (CUDA if available),
                               or "torch not installed".
                Each is timed as the median round after a compiling first one.
  aggregators   `benchmarks/aggregators.py`'s aggregators on its CIFAR CNN,
                against a device-to-device copy of the same stacked parameters
                (`jax.device_put(..., may_alias=False)`), M = 100 and 1,000.
  main job      `pflax-run` (digits, 8 algorithms, 40 rounds) in fresh
                processes: with `--no-compilation-cache` (no persistent cache,
                the run's own in a temporary folder), then twice with an empty
                cache directory of its own (the first run fills it, the second
                finds it warm); on a GPU, cold once more with XLA-GPU's GEMM and
                convolution autotuning off (`AUTOTUNING_OFF`), the candidate
                for the cold target: its share of the compilation.
  leaderboard   `benchmarks/leaderboard.py --slice --json FILE` (PFLlib's
                algorithms, 3 seeds, both settings side by side, 10 rounds:
                `--leaderboard-rounds`) and its projection of the whole
                leaderboard at 2,000 rounds; then FedAvg's and Ditto's settings
                apart (`--apart`), one after the other as before
                `sweep_settings`, against side by side; then FedAvg and Ditto
                with `--precision bf16`: accuracy and time against float32.
  runs          a round of a sweep of 3 seeds (FedAvg, the CNN, 20 clients of
                1,000 samples, 750 to train on: 75 steps of B = 10, one epoch,
                strategy "vmap"; more steps than `train.MAX_FULL_UNROLL`, so a
                rolled loop on any backend, as on a GPU): the clients of all
                runs trained on one client axis (pflax's layout), each run's
                clients on their own axis inside the vmap over runs (the layout
                before, and on a mesh), and one run of the 3 x 20 clients (the
                baseline: the same local steps at once).
  targets       issue 30's targets, each met, not met, or unmeasured and why
                (a GPU target in a run on a CPU, a section not run).

`--quick` runs every section at tiny sizes (M = 2, 8 samples, the main job 1
round of one algorithm on 4 clients) in a minute or two on a CPU: a smoke test,
which CI runs; its numbers say nothing about a GPU.

The sections run in the order of `--sections`, and the report is written after
each one, so a run stopped midway keeps what it measured. `--budget SECONDS`
bounds the whole run: once it is spent, the cases not started are reported as
not run, a `pflax-run` under way is stopped (the leaderboard slice keeps its
finished sweeps: SIGINT), and the targets they measure stay unmeasured.
`benchmarks/gpu_device.sh` runs this within one call of a lent GPU.

Usage:
  python benchmarks/gpu.py                                # on a GPU
  python benchmarks/gpu.py --budget 480                   # at most about 8 minutes
  python benchmarks/gpu.py --data-dir .fmnist --sections training main leaderboard
  python benchmarks/gpu.py --sections training --clients 20 100
  python benchmarks/gpu.py --quick --out /tmp/gpu_quick.md
  # without a GPU (benchmarks/results/gpu.md, on 2 cores and 24 GB):
  python benchmarks/gpu.py --sections training aggregators main --clients 20 100 \
      --aggregator-clients 100
"""

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing pflax

from pflax._src.cli import leaderboard  # pylint: disable=g-import-not-at-top,wrong-import-position
from pflax import losses  # pylint: disable=g-import-not-at-top,wrong-import-position
from pflax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from pflax import train  # pylint: disable=g-import-not-at-top,wrong-import-position

SAMPLES, BATCH, LR, CLASSES = 100, 10, 0.01, 10
INPUT_SHAPES = {"cnn": (28, 28, 1), "mlp": (784,)}
SECTIONS = ("training", "aggregators", "main", "leaderboard", "runs")
BASELINE = "plain vmap"


LEADERBOARD_ROUNDS = 10
"""Rounds of the leaderboard section's slice. Its projection needs only steady
rounds (rounds 2 to R - 1 are timed); `benchmarks/leaderboard.py --slice` runs
the issue's 100 rounds, whose 16 sweeps alone outlast this benchmark's 8 minutes
(about 6 minutes on a GPU at the 2-hour target, 20 at the issue's measured pace)."""


class Sizes:
  """Sizes of a run: full (a GPU) or `--quick` (a smoke run on a CPU); where the
  leaderboard finds Fashion-MNIST's IDX files (`data_dir`, default Debian's)."""

  def __init__(self, quick: bool, clients: list[int] | None,
               aggregator_clients: list[int] | None = None,
               leaderboard_rounds: int = LEADERBOARD_ROUNDS,
               data_dir: str | None = None):
    self.quick = quick
    self.clients = clients or ([2] if quick else [20, 100, 1000])
    self.samples, self.batch = (8, 4) if quick else (SAMPLES, BATCH)
    self.min_seconds, self.max_rounds = (0.0, 1) if quick else (1.0, 20)
    self.aggregator_clients = aggregator_clients or ([4] if quick else [100, 1000])
    self.leaderboard_rounds = leaderboard_rounds
    self.data_dir = data_dir


class Budget:
  """The seconds a run may still take (`--budget`; None: unbounded)."""

  def __init__(self, seconds: float | None = None):
    self.seconds = seconds
    self.deadline = None if seconds is None else time.monotonic() + seconds

  def left(self) -> float | None:
    """Seconds left (at least 0), or None when unbounded."""
    return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

  def spent(self) -> bool:
    """Whether no second is left."""
    return self.left() == 0.0


UNBOUNDED = Budget()
NOT_RUN = "not run: the time budget was spent"


def _time_round(run_round: Callable[[], Any], min_seconds: float,
                max_rounds: int) -> dict[str, float]:
  """`{"round": median s, "compile": first round minus it}`: a first (compiling)
  round, then rounds until `min_seconds` are timed (at least one, at most
  `max_rounds`)."""
  start = time.perf_counter()
  jax.block_until_ready(run_round())
  first = time.perf_counter() - start
  times: list[float] = []
  while not times or (sum(times) < min_seconds and len(times) < max_rounds):
    start = time.perf_counter()
    jax.block_until_ready(run_round())
    times.append(time.perf_counter() - start)
  steady = statistics.median(times)
  return {"round": steady, "compile": max(first - steady, 0.0)}


def _model(name: str) -> Any:
  return models.CNN(CLASSES) if name == "cnn" else models.MLP(CLASSES)


def _data(name: str, m: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(m, samples, *INPUT_SHAPES[name])).astype(np.float32)
  y = rng.integers(0, CLASSES, size=(m, samples)).astype(np.int32)
  return x, y


def _mean_cross_entropy(model: Any) -> Callable[..., jax.Array]:
  def loss(params, bx, by):
    logits = model.apply({"params": params}, bx)
    return optax.softmax_cross_entropy_with_integer_labels(logits, by).mean()
  return loss


def plain_vmap(model: Any, lr: float) -> Callable[..., Any]:
  """The reference: `epoch(stacked_params, xs, ys)` with batches `(S, M, B, ...)`,
  a `lax.scan` over the S steps of `jax.vmap(jax.grad(loss))` and SGD."""
  grads = jax.vmap(jax.grad(_mean_cross_entropy(model)))

  def step(params, batch):
    g = grads(params, *batch)
    return jax.tree.map(lambda p, d: p - lr * d, params, g), None

  return jax.jit(lambda params, xs, ys: jax.lax.scan(step, params, (xs, ys))[0])


def fused(model: Any, lr: float) -> Callable[..., Any]:
  """The ceiling: one model, `epoch(params, xs, ys)` on batches `(S, M * B, ...)`."""
  grad = jax.grad(_mean_cross_entropy(model))

  def step(params, batch):
    return jax.tree.map(lambda p, d: p - lr * d, params, grad(params, *batch)), None

  return jax.jit(lambda params, xs, ys: jax.lax.scan(step, params, (xs, ys))[0])


def _steps_first(a: np.ndarray, batch: int) -> jax.Array:
  """`(M, N, ...)` -> `(N / B, M, B, ...)`: the batches of every step, laid out."""
  m, n = a.shape[:2]
  return jnp.asarray(a.reshape(m, n // batch, batch, *a.shape[2:]).swapaxes(0, 1))


def jax_round(impl: str, model_name: str, m: int, sizes: Sizes) -> Callable[[], Any]:
  """One round of `impl` (any but "torch"), ready to call: inputs built, nothing
  compiled."""
  model = _model(model_name)
  x, y = _data(model_name, m, sizes.samples)
  one = jax.jit(model.init)(jax.random.key(0),
                            jnp.zeros((1, *INPUT_SHAPES[model_name])))["params"]
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (m, *a.shape)), one)
  if impl == BASELINE:
    epoch, xs, ys = plain_vmap(model, LR), _steps_first(x, sizes.batch), _steps_first(
        y, sizes.batch)
    return lambda: epoch(stacked, xs, ys)
  if impl == "fused":
    merge = lambda a: a.reshape(a.shape[0], m * sizes.batch, *a.shape[3:])
    epoch = fused(model, LR)
    xs, ys = merge(_steps_first(x, sizes.batch)), merge(_steps_first(y, sizes.batch))
    return lambda: epoch(one, xs, ys)

  def loss_fn(params, context, batch, key):
    del context, key
    return losses.cross_entropy(model.apply({"params": params}, batch.x), batch.y,
                                batch.mask)

  words = impl.split()  # "pflax <strategy> [bf16]"
  optimizer = optax.sgd(LR)
  trainer = train.make_trainer(loss_fn, optimizer, epochs=1, batch_size=sizes.batch,
                               strategy=words[1],
                               precision="bf16" if "bf16" in words else "float32")
  opt_state = train.init_opt_state(optimizer, stacked)
  xs, ys = jnp.asarray(x), jnp.asarray(y)
  valid = jnp.ones((m, sizes.samples), bool)
  keys = jax.random.split(jax.random.key(1), m)
  return lambda: trainer(stacked, opt_state, None, xs, ys, valid, keys)


def torch_round(model_name: str, m: int, sizes: Sizes) -> Callable[[], Any] | None:
  """A PFLlib-style PyTorch round (per client: copy the global weights, then per
  mini-batch `zero_grad`, `backward`, `step`); None without torch."""
  try:
    import torch  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  except ImportError:
    return None
  from torch import nn  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.manual_seed(0)
  if model_name == "cnn":  # PFLlib's FedAvgCNN(in_features=1, dim=1024)
    make = lambda: nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, CLASSES)).to(device)
    shape = (1, 28, 28)
  else:
    make = lambda: nn.Sequential(nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200),
                                 nn.ReLU(), nn.Linear(200, CLASSES)).to(device)
    shape = (784,)
  rng = np.random.default_rng(0)
  xs = torch.from_numpy(rng.normal(size=(m, sizes.samples, *shape)).astype(
      np.float32)).to(device)
  ys = torch.from_numpy(rng.integers(0, CLASSES, size=(m, sizes.samples))).to(device)
  global_model, model = make(), make()
  optimizer = torch.optim.SGD(model.parameters(), lr=LR)
  criterion = nn.CrossEntropyLoss()

  def run_round():
    for i in range(m):
      model.load_state_dict(global_model.state_dict())
      model.train()
      order = torch.randperm(sizes.samples, device=device)
      for start in range(0, sizes.samples, sizes.batch):
        idx = order[start:start + sizes.batch]
        optimizer.zero_grad()
        criterion(model(xs[i][idx]), ys[i][idx]).backward()
        optimizer.step()
    if device == "cuda":
      torch.cuda.synchronize()

  return run_round


def training_impls() -> tuple[str, ...]:
  """The implementations of the training section, the baseline first."""
  impls = [BASELINE, "pflax vmap", "pflax steps", "pflax steps bf16"]
  if train.default_strategy() != "vmap":
    impls.append("pflax auto")
  return (*impls, "fused", "torch")


def training_rows(sizes: Sizes, model_names: tuple[str, ...] = ("cnn", "mlp"),
                  impls: tuple[str, ...] | None = None, budget: Budget = UNBOUNDED
                  ) -> list[dict[str, Any]]:
  """Rows `{model, M, impl, round, compile}` (round None: not measured, with a
  `note`: torch missing, or the `budget` spent before the case started)."""
  rows = []
  for model_name in model_names:
    for m in sizes.clients:
      for impl in impls or training_impls():
        row = {"model": model_name, "M": m, "impl": impl}
        if budget.spent():
          rows.append({**row, "round": None, "note": NOT_RUN})
          continue
        run_round = (torch_round(model_name, m, sizes) if impl == "torch"
                     else jax_round(impl, model_name, m, sizes))
        if run_round is None:
          rows.append({**row, "round": None, "note": "torch not installed"})
          continue
        rows.append({**row, **_time_round(run_round, sizes.min_seconds,
                                          sizes.max_rounds)})
        print(f"training {model_name} M={m} {impl}: "
              f"{m * sizes.samples / rows[-1]['round']:,.0f} samples/s", file=sys.stderr)
        jax.clear_caches()
  return rows


def _rounds_by_run(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str], float | None]:
  """`{(model, M, impl): median round seconds}` of the training rows."""
  return {(r["model"], r["M"], r["impl"]): r["round"] for r in rows}


def training_markdown(rows: list[dict[str, Any]], samples: int) -> str:
  """Samples/s per row, its ratio to the plain vmap of the same model and M, and
  its share of the fused ceiling."""
  round_of = _rounds_by_run(rows)
  lines = [f"| model | M | implementation | samples/s | / {BASELINE} | share of fused "
           "| compile s |", "|---|---:|---|---:|---:|---:|---:|"]
  for r in rows:
    if r["round"] is None:
      lines.append(f"| {r['model']} | {r['M']} | {r['impl']} | {r['note']} | | | |")
      continue
    base = round_of.get((r["model"], r["M"], BASELINE))
    ceiling = round_of.get((r["model"], r["M"], "fused"))
    ratio = f"{base / r['round']:.2f}x" if base else ""
    share = f"{ceiling / r['round']:.2f}" if ceiling else ""
    lines.append(f"| {r['model']} | {r['M']} | {r['impl']} | "
                 f"{r['M'] * samples / r['round']:,.0f} | {ratio} | {share} | "
                 f"{r['compile']:.1f} |")
  return "\n".join(lines)


def _load_benchmark(name: str) -> Any:
  spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def aggregator_markdown(sizes: Sizes, budget: Budget = UNBOUNDED) -> str:
  """Each aggregator's median time against a device-to-device copy of the same
  stacked parameters (`aggregators.py`'s model and aggregators), each M while
  the `budget` lasts."""
  jax.devices()  # the backend first: aggregators.py's --quick flags must not apply
  agg = _load_benchmark("aggregators")
  model, classes = (agg.TINY, 10) if sizes.quick else (agg.FULL, 10)
  repeats = 3 if sizes.quick else 7
  lines = ["| aggregator | M | ms | / copy |", "|---|---:|---:|---:|"]
  for m in sizes.aggregator_clients:
    if budget.spent():
      lines.append(f"| all | {m} | {NOT_RUN} | |")
      continue
    kp, kc, kk = jax.random.split(jax.random.key(0), 3)
    params, step = jax.jit(lambda k, m=m: agg.stacked_params(k, model, m, classes,
                                                             copies=2))(kp)
    received = jax.jit(lambda p, d: jax.tree.map(lambda x, s: x - 0.1 * s, p, d))(
        params, step)
    counts = jax.random.randint(kc, (m, classes), 0, 50)
    n = jnp.sum(counts, axis=1).astype(jnp.float32)
    state = agg.aggregate.fedrema_init(m)
    copy = lambda p: jax.device_put(p, may_alias=False)
    fns = {"device-to-device copy": (copy, (params,))}
    fns.update({name: (jax.jit(fn), (params, received, counts, n, state, kk))
                for name, fn in agg.aggregators(model).items()})
    ms = agg.median_ms(fns, repeats)
    base = ms["device-to-device copy"]
    lines += [f"| {name} | {m} | {t:.2f} | {t / base:.1f}x |" for name, t in ms.items()]
    jax.clear_caches()
  return "\n".join(lines)


def _pflax_run(args: list[str], env: dict[str, str], timeout: float | None = None
               ) -> float | None:
  """Seconds of one `pflax-run` in a fresh process; None when it outlasts
  `timeout` (it is stopped)."""
  start = time.perf_counter()
  try:
    out = subprocess.run([sys.executable, "-m", "pflax", *args],
                         capture_output=True, text=True, check=False, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                         timeout=timeout)
  except subprocess.TimeoutExpired:
    return None
  if out.returncode != 0:
    raise RuntimeError(f"pflax-run {' '.join(args)} failed:\n{out.stderr[-3000:]}")
  return time.perf_counter() - start


def _main_job_args(sizes: Sizes) -> list[str]:
  return (["--algorithms", "fedavg", "--rounds", "1", "--clients", "4",
           "--local-epochs", "1"] if sizes.quick else [])


AUTOTUNING_OFF = "--xla_gpu_autotune_level=0"
"""The XLA flag that turns XLA-GPU's GEMM and convolution autotuning off: the
main job's compile-time candidate, measured on a GPU (`main_job_seconds`)."""


def main_job_seconds(sizes: Sizes, backend: str | None = None,
                     budget: Budget = UNBOUNDED) -> dict[str, float | None]:
  """Seconds of the main job cold (`--no-compilation-cache`), filling an empty
  cache, and with that cache warm: `{"cold", "filling", "warm"}`; on a GPU
  (`backend`, default JAX's) also cold with autotuning off, `"cold, no
  autotuning"` (`AUTOTUNING_OFF` added to `XLA_FLAGS`). None: not run, or
  stopped, when the `budget` was spent."""
  with tempfile.TemporaryDirectory() as tmp:
    common = [*_main_job_args(sizes), "--no-progress", "--out", os.path.join(tmp, "out")]
    cache = {"PFLAX_CACHE_DIR": os.path.join(tmp, "cache")}
    runs = {"cold": ([*common, "--no-compilation-cache"], {}),
            "filling": (common, cache), "warm": (common, cache)}
    if (backend or jax.default_backend()) == "gpu":
      flags = f"{os.environ.get('XLA_FLAGS', '')} {AUTOTUNING_OFF}".strip()
      runs["cold, no autotuning"] = ([*common, "--no-compilation-cache"],
                                     {"XLA_FLAGS": flags})
    return {name: None if budget.spent() else _pflax_run(args, env, budget.left())
            for name, (args, env) in runs.items()}


def _seconds(value: float | None) -> str:
  return "not run or stopped: the time budget was spent" if value is None else f"{value:.1f}"


def main_job_markdown(sizes: Sizes, seconds: dict[str, float]) -> str:
  shown = " ".join(_main_job_args(sizes)) or "(the defaults)"
  return "\n".join([
      f"`pflax-run {shown}`, seconds of the whole process:", "",
      "| run | s |", "|---|---:|",
      f"| cold, `--no-compilation-cache` (the run's own temporary cache) "
      f"| {_seconds(seconds['cold'])} |",
      f"| cold, filling an empty compilation cache | {_seconds(seconds['filling'])} |",
      f"| warm compilation cache | {_seconds(seconds['warm'])} |",
      *([f"| cold, `--no-compilation-cache`, XLA-GPU's autotuning off (`XLA_FLAGS="
         f"{AUTOTUNING_OFF}`; the candidate) | "
         f"{_seconds(seconds['cold, no autotuning'])} |"]
        if "cold, no autotuning" in seconds else [])])


APART_ALGORITHMS = ("fedavg", "ditto")
"""The algorithms whose settings the leaderboard section also runs apart."""

PRECISION_ALGORITHMS = ("fedavg", "ditto")
"""The algorithms the leaderboard section also runs with `--precision bf16`."""

INTERRUPT_GRACE = 60.0
"""Seconds a leaderboard slice has, once interrupted, to write its finished rows."""


def _slice_flags(sizes: Sizes) -> list[str]:
  """`benchmarks/leaderboard.py --slice`'s flags of the leaderboard section's sizes."""
  rounds = str(sizes.leaderboard_rounds)
  return ((["--quick"] if sizes.quick else ["--rounds", rounds, "--eval-every", rounds])
          + (["--data-dir", sizes.data_dir] if sizes.data_dir else []))


def _leaderboard_slice(sizes: Sizes, extra: list[str], budget: Budget = UNBOUNDED
                       ) -> dict | str:
  """`benchmarks/leaderboard.py --slice` (`_slice_flags`, then `extra`)'s JSON, or
  why not. Interrupted (SIGINT) when the `budget` is spent: its JSON then holds
  the finished rows, `"interrupted": true` and no projection."""
  script = ROOT / "benchmarks" / "leaderboard.py"
  if not script.exists():
    return "leaderboard.py not found: not measured."
  if budget.spent():
    return f"{NOT_RUN}."
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "slice.json")
    cmd = [sys.executable, str(script), "--slice", "--json", path, *_slice_flags(sizes),
           *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
      _, stderr = process.communicate(timeout=budget.left())
    except subprocess.TimeoutExpired:
      process.send_signal(signal.SIGINT)
      try:
        _, stderr = process.communicate(timeout=INTERRUPT_GRACE)
      except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
    if os.path.exists(path):
      return json.loads(pathlib.Path(path).read_text())
    return (f"leaderboard.py failed (exit {process.returncode}):\n\n```\n"
            f"{stderr[-2000:]}\n```")


def _why_unfinished(result: dict | str) -> str | None:
  """Why a slice's `result` is not whole (its error, or its interruption), or None."""
  if isinstance(result, str):
    return result
  if result.get("interrupted"):
    return (f"interrupted when the time budget was spent, after {len(result['rows'])} "
            "rows")
  return None


def leaderboard_markdown(sizes: Sizes, result: dict | str, budget: Budget = UNBOUNDED
                         ) -> str:
  """The slice's rows and projection (`result`, `_leaderboard_slice(sizes, [])`),
  then, while the `budget` lasts, the settings side by side against apart
  (`--apart`) for `APART_ALGORITHMS`, and bf16 against float32 for
  `PRECISION_ALGORITHMS`."""
  if isinstance(result, str):
    return result
  lines = ["| algorithm | setting | s / round (its sweep's) |", "|---|---|---:|"]
  lines += [f"| {r['algorithm']} | {r['setting']} | {r['seconds_per_round']:.3f} |"
            for r in result["rows"]]
  unfinished = _why_unfinished(result)
  if unfinished:
    return "\n".join(lines + ["", f"Not projected: {unfinished}."])
  lines += ["", f"Projected whole leaderboard at 2,000 rounds: "
            f"{result['projected_hours']:.2f} hours."]
  return "\n".join(lines + ["", _apart_markdown(sizes, result, budget), "",
                            _precision_markdown(sizes, result, budget)])


def _apart_markdown(sizes: Sizes, result: dict, budget: Budget) -> str:
  """`APART_ALGORITHMS`' seconds per round of both settings side by side (in
  `result`) against one after the other."""
  apart = _leaderboard_slice(sizes, ["--apart", "--algorithms", *APART_ALGORITHMS],
                             budget)
  unfinished = _why_unfinished(apart)
  if unfinished:
    return f"Settings apart: {unfinished}."
  compared = lambda rows: [r for r in rows if r["algorithm"] in APART_ALGORITHMS]
  together = leaderboard.sweep_seconds(compared(result["rows"]))
  alone = leaderboard.sweep_seconds(compared(apart["rows"]))
  return (f"Both settings side by side in one sweep against one after the other "
          f"({', '.join(APART_ALGORITHMS)}): {together:.3f} against {alone:.3f} s per "
          f"round of both ({alone / together:.2f}x).")


def _precision_markdown(sizes: Sizes, result: dict, budget: Budget) -> str:
  """`PRECISION_ALGORITHMS` with `--precision bf16` against the float32 rows of
  `result`: best accuracy (mean ± std over the seeds) and seconds per round."""
  bf16 = _leaderboard_slice(sizes, ["--precision", "bf16", "--algorithms",
                                    *PRECISION_ALGORITHMS], budget)
  unfinished = _why_unfinished(bf16)
  if unfinished:
    return f"bf16: {unfinished}."
  float32 = {(r["algorithm"], r["setting"]): r for r in result["rows"]}
  lines = ["| algorithm | setting | accuracy float32 | accuracy bf16 | s / round "
           "float32 | s / round bf16 |", "|---|---|---:|---:|---:|---:|"]
  for r in bf16["rows"]:
    f = float32[(r["algorithm"], r["setting"])]
    lines.append(f"| {r['algorithm']} | {r['setting']} | {f['accuracy_mean']:.2f} ± "
                 f"{f['accuracy_std']:.2f} | {r['accuracy_mean']:.2f} ± "
                 f"{r['accuracy_std']:.2f} | {f['seconds_per_round']:.3f} | "
                 f"{r['seconds_per_round']:.3f} |")
  first = bf16["rows"][0]
  return "\n".join([f"`--precision bf16` against float32, {first['rounds']} rounds, "
                    f"{first['seeds']} seeds (best personalized accuracy, %):", "",
                    *lines])


RUN_LAYOUTS = {"one client axis": True, "a client axis per run": False}
"""The layouts of the runs section: `engine.Plan.merge_runs`."""


def sweep_grid(config: Any, seeds: list[int], dataset: Any, merge_runs: bool,
               algorithm: str = "fedavg") -> Any:
  """The sweep of `seeds` of `algorithm` under `config` (a `simulate` grid:
  programs built, inputs placed, nothing compiled), its clients laid out by
  `merge_runs` (`engine.Plan.merge_runs`)."""
  from pflax import simulate  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from pflax._src.simulation import engine  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from pflax._src.simulation import simulate as simulate_lib  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  setups = {(None, s): simulate.prepare(config, s, dataset=dataset) for s in seeds}
  grid = simulate_lib._Grid(algorithm, config, seeds, None, (), setups, None)  # pylint: disable=protected-access
  grid.programs = engine.build_programs(dataclasses.replace(grid.plan,
                                                            merge_runs=merge_runs))
  return grid


def runs_setting(sizes: Sizes, runs: int | None = None, clients: int | None = None
                 ) -> tuple[int, int, Any, Any]:
  """`(S, M, config, dataset)` of the runs section: S seeds (default 3) of M
  clients (default 20) of the CNN (strategy "vmap"), each with the same number
  of samples of a synthetic dataset large enough for one run of S x M clients."""
  from pflax import data  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from pflax import simulate  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  default_runs, default_m, samples = (2, 2, 8) if sizes.quick else (3, 20, 1000)
  runs, m = runs or default_runs, clients or default_m
  rng = np.random.default_rng(0)
  n = 2 * runs * m * samples
  dataset = data.from_arrays(rng.normal(size=(n, *INPUT_SHAPES["cnn"])).astype(np.float32),
                             rng.integers(0, CLASSES, n))
  config = simulate.ExperimentConfig(clients=m, model="cnn", strategy="vmap",
                                     local_epochs=1, batch_size=sizes.batch,
                                     samples_per_client=samples, lr=LR)
  return runs, m, config, dataset


def runs_cases(runs: int, m: int) -> list[tuple[str, int, int, bool]]:
  """`(layout, S, M, merge_runs)`: S runs of M clients in each of `RUN_LAYOUTS`,
  then one run of S x M clients."""
  return ([(layout, runs, m, merge) for layout, merge in RUN_LAYOUTS.items()]
          + [("one run", 1, runs * m, True)])


def runs_rows(sizes: Sizes, budget: Budget = UNBOUNDED) -> list[dict[str, Any]]:
  """Rows `{layout, runs, M, round, compile}` of the runs section (`runs_cases`),
  round None for a case the `budget` left no time for."""
  runs, m, config, dataset = runs_setting(sizes)
  rows = []
  for layout, s, clients, merge in runs_cases(runs, m):
    if budget.spent():
      rows.append({"layout": layout, "runs": s, "M": clients, "round": None})
      continue
    grid = sweep_grid(dataclasses.replace(config, clients=clients), list(range(s)),
                      dataset, merge)
    carry = grid.start()
    rows.append({"layout": layout, "runs": s, "M": clients,
                 **_time_round(lambda: grid.round(carry, 0), sizes.min_seconds,
                               sizes.max_rounds)})
    print(f"runs {layout} {s} x {clients}: {rows[-1]['round']:.4f} s", file=sys.stderr)
    jax.clear_caches()
  return rows


def runs_markdown(rows: list[dict[str, Any]]) -> str:
  """Each layout's round and its ratio to one run of all the clients."""
  base = next(r["round"] for r in rows if r["runs"] == 1)
  lines = ["| layout | runs x clients | s / round | / one run of all clients | compile s |",
           "|---|---|---:|---:|---:|"]
  for r in rows:
    shown = f"| {r['layout']} | {r['runs']} x {r['M']} |"
    if r["round"] is None:
      lines.append(f"{shown} {NOT_RUN} | | |")
      continue
    ratio = f"{r['round'] / base:.2f}x" if base else ""
    lines.append(f"{shown} {r['round']:.4f} | {ratio} | {r['compile']:.1f} |")
  return "\n".join(lines)


# Issue 30's targets: `make_trainer` within 1.1x of the plain vmap at M = 20, 100
# and 1,000 for both models, and samples/s that do not fall from M = 100 to 1,000
# (on a GPU); the whole leaderboard projected at 2 hours at most (one H100); the
# main job cold in 25 s on a GPU and 35 s on two CPU cores.
TRAINER_SLOWDOWN = 1.1
LEADERBOARD_HOURS = 2.0
MAIN_JOB_SECONDS = {"gpu": 25.0, "cpu": 35.0}
TARGET_CLIENTS = (20, 100, 1000)


def _verdict(met: bool) -> str:
  return "met" if met else "**not met**"


def _trainer_targets(training: list[dict[str, Any]], impl: str) -> list[str]:
  """Rows of the trainer targets for `impl` (measured on a GPU)."""
  round_of = _rounds_by_run(training)
  slowdowns, falls = [], []
  for model_name in ("cnn", "mlp"):
    for m in TARGET_CLIENTS:
      ours, base = round_of.get((model_name, m, impl)), round_of.get(
          (model_name, m, BASELINE))
      if ours is None or base is None:
        return [f"| `{impl}` within {TRAINER_SLOWDOWN}x of the {BASELINE}, and no fall "
                f"in samples/s from M = 100 to 1,000 | not every M of "
                f"{TARGET_CLIENTS} measured | unmeasured |"]
      slowdowns.append((f"{model_name} {m}", ours / base))
    # Samples/s from M = 100 to 1,000: 1,000 / round(1,000) against 100 / round(100).
    falls.append((model_name, 10 * round_of[(model_name, 100, impl)]
                  / round_of[(model_name, 1000, impl)]))
  shown = ", ".join(f"{name}: {ratio:.2f}x" for name, ratio in slowdowns)
  rising = ", ".join(f"{name}: {ratio:.2f}x" for name, ratio in falls)
  return [f"| `{impl}` within {TRAINER_SLOWDOWN}x of the {BASELINE} (round time "
          f"over its) | {shown} | "
          f"{_verdict(all(r <= TRAINER_SLOWDOWN for _, r in slowdowns))} |",
          f"| `{impl}`: samples/s at M = 1,000 against M = 100 at least 1x | {rising} | "
          f"{_verdict(all(r >= 1.0 for _, r in falls))} |"]


def targets_markdown(backend: str, cores: int, training: list[dict[str, Any]] | None,
                     main_job: dict[str, float] | None,
                     projected_hours: float | None) -> str:
  """Each of issue 30's targets this run could measure, met or not met, with its
  number; the others unmeasured, saying why (a GPU target on a CPU, a section
  not run). Cold is both `--no-compilation-cache` and filling an empty cache."""
  on_gpu = backend == "gpu"
  lines = ["| target | measured | verdict |", "|---|---|---|"]
  no_gpu = f"| {{}} | no GPU: this run is on `{backend}` | unmeasured |"
  for impl in ("pflax vmap", "pflax steps"):
    if not on_gpu:
      lines.append(no_gpu.format(f"`{impl}` within {TRAINER_SLOWDOWN}x of the "
                                 f"{BASELINE}; samples/s not falling from M = 100 to 1,000"))
    elif training is None:
      lines.append(f"| `{impl}` against the {BASELINE} | training section not run "
                   "| unmeasured |")
    else:
      lines += _trainer_targets(training, impl)
  board = f"the whole leaderboard projected at {LEADERBOARD_HOURS:g} hours at most (one H100)"
  if not on_gpu:
    lines.append(no_gpu.format(board))
  elif projected_hours is None:
    lines.append(f"| {board} | leaderboard section not run, failed or stopped by the "
                 "time budget | unmeasured |")
  else:
    lines.append(f"| {board} | {projected_hours:.2f} hours | "
                 f"{_verdict(projected_hours <= LEADERBOARD_HOURS)} |")
  for where, limit in MAIN_JOB_SECONDS.items():
    on = "a GPU" if where == "gpu" else "two CPU cores"
    job = f"the main job cold in {limit:g} s at most ({on})"
    if (where == "gpu") != on_gpu:
      lines.append(f"| {job} | this run is on `{backend}` | unmeasured |")
    elif main_job is None:
      lines.append(f"| {job} | main job section not run | unmeasured |")
    elif main_job["cold"] is None or main_job["filling"] is None:
      lines.append(f"| {job} | {NOT_RUN} | unmeasured |")
    else:
      judged = on_gpu or cores == 2
      slowest = max(main_job["cold"], main_job["filling"])
      lines.append(f"| {job} | {main_job['cold']:.1f} s without the persistent cache, "
                   f"{main_job['filling']:.1f} s filling an empty one"
                   f"{'' if judged else f' (on {cores} cores, not 2)'} | "
                   f"{_verdict(slowest <= limit) if judged else 'unmeasured'} |")
  return "\n".join(lines)


def _versions() -> list[str]:
  import flax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  import jaxlib  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  device = jax.devices()[0]
  driver = "none"
  if shutil.which("nvidia-smi"):
    query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           check=False)
    driver = query.stdout.strip().splitlines()[0] if query.stdout.strip() else "unknown"
  try:
    import torch  # pylint: disable=g-import-not-at-top,import-outside-toplevel
    torch_version = torch.__version__
  except ImportError:
    torch_version = "not installed"
  return [f"- device: {device.device_kind} ({jax.default_backend()}, "
          f"{jax.device_count()} device(s)); host: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs",
          f"- driver: {driver}",
          f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, "
          f"torch {torch_version}"]


def _header(sizes: Sizes, command: str | None) -> list[str]:
  parts = ["# pflax on one device" + (" (--quick: a smoke run)" if sizes.quick else ""),
           "", f"Measured {datetime.date.today().isoformat()}"
           + (f" by `{command}`." if command else "."), "", *_versions()]
  if sizes.quick:
    parts += ["", "`--quick` runs every section at tiny sizes to check that the "
              "benchmark runs: its numbers measure no target, and on a CPU they say "
              "nothing about a GPU. The GPU numbers are unmeasured here."]
  return parts


def report(sizes: Sizes, sections: tuple[str, ...], command: str | None = None,
           budget: Budget = UNBOUNDED, write: Callable[[str], None] | None = None
           ) -> str:
  """The whole markdown report of the chosen sections, in their order
  (`command`: the command line that ran it, shown under the date), each while
  the `budget` lasts; `write` gets the report so far after each section."""
  started = time.perf_counter()
  parts = _header(sizes, command)
  measured: dict[str, Any] = {}

  def section(title: str, body: Callable[[], str]) -> None:
    begun = time.perf_counter()
    text = body()
    parts.extend(["", f"## {title}", "", text, "",
                  f"(this section: {time.perf_counter() - begun:.0f} s)"])
    if write:
      write("\n".join(parts) + "\n")

  def training() -> str:
    measured["training"] = training_rows(sizes, budget=budget)
    return (f"{sizes.samples} samples per client, batches of {sizes.batch}, one epoch "
            f"of SGD; samples/s of the median round, ratios against the {BASELINE} of "
            f"the same model and M.\n\n"
            + training_markdown(measured["training"], sizes.samples))

  def main_job() -> str:
    measured["main"] = main_job_seconds(sizes, budget=budget)
    return main_job_markdown(sizes, measured["main"])

  def board() -> str:
    result = _leaderboard_slice(sizes, [], budget)
    if isinstance(result, dict):
      measured["projected_hours"] = result["projected_hours"]
    return leaderboard_markdown(sizes, result, budget)

  def runs() -> str:
    return ("FedAvg's round, the CNN, one epoch in batches of "
            f"{sizes.batch}, strategy \"vmap\"; ratios against one run of all the "
            "clients.\n\n" + runs_markdown(runs_rows(sizes, budget)))

  bodies = {"training": ("Local training", training),
            "aggregators": ("Aggregators against a device-to-device copy",
                            lambda: aggregator_markdown(sizes, budget)),
            "main": ("The main job", main_job),
            "leaderboard": ("PFLlib's leaderboard, a slice", board),
            "runs": ("A sweep's runs side by side", runs)}
  for name in sections:
    section(*bodies[name])
  parts += ["", "## Issue 30's targets", ""]
  parts += (["`--quick` measures no target."] if sizes.quick else [
      targets_markdown(jax.default_backend(), train.default_threads(),
                       measured.get("training"), measured.get("main"),
                       measured.get("projected_hours"))])
  parts += ["", f"The whole benchmark took {time.perf_counter() - started:.0f} s"
            + ("." if budget.seconds is None else
               f", within a budget of {budget.seconds:.0f} s.")]
  text = "\n".join(parts) + "\n"
  if write:
    write(text)
  return text


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes, about a minute on a CPU (a smoke run)")
  parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                      help="the sections to run, in this order")
  parser.add_argument("--clients", type=int, nargs="+", default=None,
                      help="M of the training section (default: 20 100 1000)")
  parser.add_argument("--aggregator-clients", type=int, nargs="+", default=None,
                      help="M of the aggregators section (default: 100 1000; 1,000 "
                      "stacked CIFAR CNNs need about 28 GB)")
  parser.add_argument("--leaderboard-rounds", type=int, default=LEADERBOARD_ROUNDS,
                      help=f"rounds of the leaderboard slice (default "
                      f"{LEADERBOARD_ROUNDS}; the issue's slice: 100)")
  parser.add_argument("--data-dir", default=None,
                      help="a folder of Fashion-MNIST's IDX files for the leaderboard "
                      "(default: Debian's dataset-fashion-mnist)")
  parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                      help="stop starting work after this many seconds; what is not "
                      "run is reported as such (default: no limit)")
  parser.add_argument("--out", default=None,
                      help="the markdown file to write, after each section (default: "
                      "benchmarks/results/gpu.md, with --quick gpu_quick_cpu.md)")
  args = parser.parse_args()
  if args.out is None:
    args.out = ROOT / "benchmarks" / "results" / ("gpu_quick_cpu.md" if args.quick
                                                  else "gpu.md")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  sizes = Sizes(args.quick, args.clients, args.aggregator_clients,
                args.leaderboard_rounds, args.data_dir)
  text = report(sizes, tuple(args.sections),
                shlex.join(["python", "benchmarks/gpu.py", *sys.argv[1:]]),
                Budget(args.budget), out.write_text)
  print(text)


if __name__ == "__main__":
  main()
