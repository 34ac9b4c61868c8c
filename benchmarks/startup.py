"""Whole-process time of a short experiment: `pflax-run` against a PyTorch script.

What a user waits for when running pflax's default job from a shell, cold: the
interpreter starting, imports, loading and partitioning digits, compiling
(no JAX persistent compilation cache: `JAX_ENABLE_COMPILATION_CACHE=false`,
and every `JAX_COMPILATION_CACHE_DIR` / `JAX_PERSISTENT_CACHE_*` variable
removed from the environment), the rounds, and writing `results.json` and the
two plots. Commands, each a fresh process:

  pflax-run ... --rounds 1   `pflax-run --algorithms fedavg --rounds 1` (the
                             `pflax-run` next to this interpreter, else
                             `python -m pflax`, run from the repository root
                             with it first on `PYTHONPATH`: the pflax of this
                             checkout);
  pflax-run ...              `pflax-run --algorithms fedavg`: the default job,
                             40 rounds (digits, 20 clients, 2 classes each,
                             5 local epochs of batches of 10, SGD lr 0.05, the
                             MLP, every client evaluated every round);
  torch_fedavg.py            `python benchmarks/torch_fedavg.py --rounds R`, a
                             PFLlib-style PyTorch script of the same job (same
                             data sizes, MLP, schedule, evaluation and output
                             files; torch's default threads unless
                             `--torch-threads`; see its docstring);
  import pflax.simulate      `python -c "import pflax.simulate"`, the import
                             cost alone (JAX, Flax, optax and pflax), against
  import torch               `python -c "import torch"`.

Both experiment commands get `--out <fresh temporary directory>` (and
pflax-run `--no-progress`). Each command runs `--repeats` times, the commands
interleaved within each repeat so that load on a shared machine hits all of
them alike; a command is timed wall-clock from `subprocess.run` to the
process's exit (`time.perf_counter` around it). The table gives the median over
processes of the wall time, its ratio to the PyTorch command of the same rounds
(> 1: pflax is slower), the time of the round loop the run itself reports
(`seconds` of its `results.json`, for pflax including the compilation of the
first round), the rest of the process (wall minus round loop: start-up,
imports, data, initialisation, writing results) and the final accuracy (mean of
the last 5 evaluations; PyTorch's partition and initialisation differ from
pflax's, so accuracies agree only roughly).

Usage:
  python benchmarks/startup.py                           # rounds 1 and 40, 3 processes each
  python benchmarks/startup.py --repeats 5 --out benchmarks/results/startup.md
  python benchmarks/startup.py --torch-threads 1         # torch_fedavg.py --threads 1
  python benchmarks/startup.py --quick                   # smoke run: 1 process, 1 round
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_SCRIPT = ROOT / "benchmarks" / "torch_fedavg.py"
DEFAULT_ROUNDS = 40
"""Rounds of pflax-run's default job (`pflax.simulate.ExperimentConfig.rounds`)."""


def _pflax_run() -> list[str]:
  """`pflax-run` of this interpreter's environment, else `python -m pflax`."""
  script = pathlib.Path(sys.executable).parent / "pflax-run"
  return [str(script)] if script.exists() else [sys.executable, "-m", "pflax"]


def commands(rounds: list[int], imports: bool,
             torch_threads: int | None) -> list[dict[str, Any]]:
  """The commands to time: label, baseline label, argv without `--out`, whether
  the command writes a results.json."""
  out = []
  if imports:
    out.append({"label": "import pflax.simulate", "baseline": "import torch",
                "argv": [sys.executable, "-c", "import pflax.simulate"], "run": False})
    out.append({"label": "import torch", "baseline": "import torch",
                "argv": [sys.executable, "-c", "import torch"], "run": False})
  threads = [] if torch_threads is None else ["--threads", str(torch_threads)]
  for r in rounds:
    flags = [] if r == DEFAULT_ROUNDS else ["--rounds", str(r)]
    torch_label = " ".join(["torch_fedavg.py --rounds", str(r), *threads])
    out.append({"label": " ".join(["pflax-run --algorithms fedavg", *flags]),
                "baseline": torch_label, "run": True,
                "argv": [*_pflax_run(), "--algorithms", "fedavg", *flags, "--no-progress"]})
    out.append({"label": torch_label, "baseline": torch_label, "run": True,
                "argv": [sys.executable, str(TORCH_SCRIPT), "--rounds", str(r), *threads]})
  return out


def cold_env() -> dict[str, str]:
  """This environment without a JAX persistent compilation cache, with this
  checkout first on `PYTHONPATH` (so even an installed pflax-run imports it)."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def measure(command: dict[str, Any], env: dict[str, str]) -> dict[str, float]:
  """Runs one command in a fresh process; its wall time, round loop, accuracy."""
  out_dir = tempfile.mkdtemp(prefix="pflax-startup-")
  argv = command["argv"] + (["--out", out_dir] if command["run"] else [])
  try:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
      raise RuntimeError(f"{command['label']} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    result = {"wall": wall}
    if command["run"]:
      run = json.loads((pathlib.Path(out_dir) / "results.json").read_text())["runs"][0]
      result.update(loop=run.get("seconds"),
                    accuracy=(run.get("personalized_accuracy") or {}).get("final"))
      missing = [p for p in ("accuracy.png", "output_norms.png")
                 if not (pathlib.Path(out_dir) / p).exists()]
      if missing:
        raise RuntimeError(f"{command['label']} wrote no {missing}")
    return result
  finally:
    shutil.rmtree(out_dir, ignore_errors=True)


def markdown(rows: list[dict[str, Any]]) -> str:
  lines = ["| command | wall s | vs torch | round loop s | rest s | final accuracy "
           "| processes |", "|---|---:|---:|---:|---:|---:|---:|"]
  walls = {r["label"]: r["wall"] for r in rows}
  for row in rows:
    base = walls.get(row["baseline"])
    ratio = "" if base is None else f"{row['wall'] / base:.2f}x"
    loop = row.get("loop")
    cells = ["" if loop is None else f"{loop:.2f}",
             "" if loop is None else f"{row['wall'] - loop:.2f}",
             "" if row.get("accuracy") is None else f"{row['accuracy']:.4f}"]
    lines.append(f"| `{row['label']}` | {row['wall']:.2f} | {ratio} | "
                 + " | ".join(cells) + f" | {row['runs']} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3,
                      help="processes per command; the median is reported")
  parser.add_argument("--rounds", type=int, nargs="+", default=[1, DEFAULT_ROUNDS],
                      help=f"rounds of the experiment commands (default: 1 {DEFAULT_ROUNDS})")
  parser.add_argument("--torch-threads", type=int, default=None,
                      help="torch_fedavg.py --threads (default: torch's own)")
  parser.add_argument("--no-imports", action="store_true",
                      help="skip the `import pflax.simulate` / `import torch` rows")
  parser.add_argument("--quick", action="store_true",
                      help="1 process per command, 1-round commands (and imports) only")
  parser.add_argument("--out", default=None, help="also write the table to this file")
  args = parser.parse_args()
  if args.quick:
    args.repeats, args.rounds = 1, [1]

  jobs = commands(args.rounds, not args.no_imports, args.torch_threads)
  env = cold_env()
  load_start = os.getloadavg()[0]
  results: dict[str, list[dict[str, float]]] = {}
  for repeat in range(args.repeats):
    for job in jobs:
      out = measure(job, env)
      results.setdefault(job["label"], []).append(out)
      extra = "".join(f", {key} {out[key]:.{digits}f}" for key, digits
                      in (("loop", 2), ("accuracy", 4)) if out.get(key) is not None)
      print(f"[{repeat + 1}/{args.repeats}] {job['label']}: {out['wall']:.2f} s{extra}",
            file=sys.stderr, flush=True)
  rows = []
  for job in jobs:
    runs = results[job["label"]]
    row = {"label": job["label"], "baseline": job["baseline"], "runs": len(runs),
           "wall": statistics.median(r["wall"] for r in runs)}
    for key in ("loop", "accuracy"):
      values = [r[key] for r in runs if r.get(key) is not None]
      if values:
        row[key] = statistics.median(values)
    rows.append(row)
  text = (f"Whole processes, cold (no JAX compilation cache); median of {args.repeats} "
          f"processes per command, interleaved; {os.cpu_count()} CPUs, load average "
          f"{load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n\n"
          + markdown(rows))
  print(text)
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
  main()
