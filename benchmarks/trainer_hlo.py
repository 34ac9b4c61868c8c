"""Kernels and memory traffic of pflax's trainers against the plain-vmap reference.

Each program (`make_trainer(strategy="vmap")`, `make_trainer(strategy="steps")`
and `gpu.plain_vmap`, one epoch of 100 samples per client in batches of 10, SGD)
is compiled with a rolled loop (`unroll=False`, what a GPU gets by default) and
its optimized HLO read:

- the loop body, i.e. one local step (the body of the while loop with the most
  fusions): its kernels (every instruction that runs, fusions, library calls
  and copies) and the bytes they move by a simple model, each kernel's output
  plus its distinct operands, where an operand of a gather or dynamic slice
  counts at most the output's size (it reads what it writes); the ratio of
  these bytes to the baseline's (the plain vmap; with `--round`, one run of
  all the clients);
- the whole program's gathers, scatters, while loops, sorts, dynamic slices,
  selects, copies and conditionals.

`--target h100` compiles XLA-GPU's program for an NVIDIA H100 SXM on any
machine, without a GPU or a CUDA driver: jax's CUDA plugin compiles for a
described device (`jax.experimental.topologies`), nothing runs. It needs the
plugin (`pip install "jax[cuda12]"`, the version of the jax installed). Such a
compilation autotunes nothing: the kernels are XLA's default choices (Triton
matmuls with fused epilogues), where a GPU may pick others by measuring.

`--precision bf16` compiles pflax's trainers in bfloat16 (`make_trainer`'s
`precision`); `--runs R` vmaps them over R runs of M clients, as a sweep's
round program does, against the plain vmap of the R x M clients.

`--round ALGORITHM` compiles instead the engine's round of a sweep of `--runs`
seeds (default 3) of the CNN (M clients of 1,000 samples, `gpu.runs_setting`)
in both layouts of its clients (`gpu.RUN_LAYOUTS`: the runs' clients on one
axis, or each run's on its own inside the vmap over runs) against one run of
the runs x M clients.

Usage:
  python benchmarks/trainer_hlo.py                  # default backend, M = 8
  python benchmarks/trainer_hlo.py --target h100 --clients 20 100 1000
  python benchmarks/trainer_hlo.py --target h100 --clients 100 --precision bf16
  python benchmarks/trainer_hlo.py --target h100 --clients 20 --models cnn --runs 3
  python benchmarks/trainer_hlo.py --clients 100 --models cnn --dump DIR
  python benchmarks/trainer_hlo.py --target h100 --clients 20 --round fedavg ditto
"""

import argparse
import collections
import dataclasses
import importlib.util
import pathlib
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("gpu", ROOT / "benchmarks" / "gpu.py")
gpu = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu)

PROGRAM_OPS = ("while", "gather", "scatter", "sort", "dynamic-slice",
               "dynamic-update-slice", "select", "copy", "conditional")
NOT_KERNELS = ("parameter", "get-tuple-element", "constant", "tuple", "bitcast")
"""Instructions of a loop body that launch no kernel."""

BYTES_PER_ELEMENT = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                     "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                     "f64": 8, "c64": 8, "c128": 16}

H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
"""The H100 SXM (80 GB HBM3) as XLA's `GpuTargetConfigProto` text: 132 SMs of
228 KiB shared memory, 50 MiB of L2, 3.35 TB/s, compute capability 9.0."""

TARGETS = ("backend", "h100")


class Instruction(NamedTuple):
  """One HLO instruction: its result shape, opcode, operand names and the
  computation it calls (fusions), if any."""
  name: str
  shape: str
  op: str
  operands: list[str]
  calls: str | None


def _ops(text: str) -> collections.Counter:
  return collections.Counter(re.findall(r" = .*? ([a-z][a-z0-9\-]*)\(", text))


def _computations(hlo: str) -> dict[str, str]:
  """`{name: text}` of the computations of an HLO module's text."""
  out = {}
  for block in re.split(r"\n(?=\S.*\{\s*$)", hlo, flags=re.M):
    head = block.lstrip().split(None, 2)
    if head and head[0] == "ENTRY":
      head = head[1:]
    if head:
      out[head[0].lstrip("%")] = block
  return out


def _instructions(computation: str) -> Iterator[Instruction]:
  for line in computation.splitlines()[1:]:
    found = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(([^)]*)\)(.*)",
                     line)
    if found:
      name, shape, op, operands, attributes = found.groups()
      calls = re.search(r"calls=%?([\w.\-]+)", attributes)
      yield Instruction(name, shape, op, re.findall(r"%([\w.\-]+)", operands),
                        calls.group(1) if calls else None)


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape, tuples summed (`"(f32[2,3]{1,0}, pred[])"` -> 25)."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * BYTES_PER_ELEMENT.get(dtype, 0)
  return total


def _loop_body(hlo: str, computations: dict[str, str]) -> str:
  """The body of the while loop with the most fusions: the training loop's."""
  bodies = [computations[name] for name in re.findall(r"body=%?([\w.\-]+)", hlo)]
  return max(bodies, key=lambda text: _ops(text)["fusion"])


def step_traffic(hlo: str) -> tuple[int, int]:
  """Kernels of the training loop's body and the bytes they move (the model above)."""
  computations = _computations(hlo)
  shapes: dict[str, str] = {}
  kernels = traffic = 0
  for inst in _instructions(_loop_body(hlo, computations)):
    shapes[inst.name] = inst.shape
    if inst.op in NOT_KERNELS:
      continue
    out = shape_bytes(inst.shape)
    called = computations.get(inst.calls, "")
    reads_slices = inst.op in ("gather", "dynamic-slice") or re.search(
        r" (gather|dynamic-slice)\(", called)
    operands = [shape_bytes(shapes.get(o, "")) for o in dict.fromkeys(inst.operands)]
    kernels += 1
    traffic += out + sum(min(b, out) if reads_slices else b for b in operands)
  return kernels, traffic


def _over_runs(fn: Any, args: tuple[Any, ...], runs: int) -> tuple[Any, tuple[Any, ...]]:
  """`fn` vmapped over a leading axis of `runs` copies of `args`: the layout of
  a sweep's round, one program over its runs (`pflax.simulate.sweep`)."""
  copies = jax.tree.map(lambda a: jnp.broadcast_to(a, (runs, *a.shape)), args)
  return jax.jit(jax.vmap(fn)), copies


def programs(model_name: str, m: int, precision: str = "float32", runs: int | None = None
             ) -> dict[str, tuple[Any, tuple[Any, ...]]]:
  """`{name: (jitted function, arguments)}` of the three programs, pflax's in
  `precision` (`make_trainer`'s), the plain vmap's in float32, the baseline last.

  With `runs`, pflax's trainers are vmapped over that many runs of M clients
  (`_over_runs`) and the plain vmap trains their `runs * M` clients on one
  axis: what a sweep's round costs against the same clients trained at once.
  """
  if runs is not None:
    out = programs(model_name, m, precision)
    merged = programs(model_name, runs * m, precision)[gpu.BASELINE]
    return {f"{name} over runs ({runs})": _over_runs(*out[name], runs)
            for name in out if name != gpu.BASELINE} | {gpu.BASELINE: merged}
  sizes = gpu.Sizes(quick=False, clients=[m])
  model = gpu._model(model_name)  # pylint: disable=protected-access
  x, y = gpu._data(model_name, m, sizes.samples)  # pylint: disable=protected-access
  one = model.init(jax.random.key(0), jnp.zeros((1, *gpu.INPUT_SHAPES[model_name])))
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (m, *a.shape)), one["params"])
  optimizer = optax.sgd(gpu.LR)

  def loss_fn(params, context, batch, key):
    del context, key
    return gpu.losses.cross_entropy(model.apply({"params": params}, batch.x), batch.y,
                                    batch.mask)

  trainer_args = (stacked, gpu.train.init_opt_state(optimizer, stacked), None,
                  jnp.asarray(x), jnp.asarray(y), jnp.ones((m, sizes.samples), bool),
                  jax.random.split(jax.random.key(1), m))
  out = {f"pflax {s}": (gpu.train.make_trainer(loss_fn, optimizer, epochs=1,
                                               batch_size=sizes.batch, strategy=s,
                                               unroll=False, precision=precision),
                                 trainer_args)
         for s in ("vmap", "steps")}
  steps_first = gpu._steps_first  # pylint: disable=protected-access
  out[gpu.BASELINE] = (gpu.plain_vmap(model, gpu.LR),
                       (stacked, steps_first(x, sizes.batch), steps_first(y, sizes.batch)))
  return out


def round_programs(algorithm: str, m: int, runs: int | None
                   ) -> dict[str, tuple[Any, tuple[Any, ...]]]:
  """`{layout: (round program, arguments)}` of `algorithm`'s sweep round in each
  of `gpu.runs_cases` (the arguments' shapes and dtypes)."""
  sizes = gpu.Sizes(quick=False, clients=[m])
  runs, m, config, dataset = gpu.runs_setting(sizes, runs, m)
  out = {}
  for layout, s, clients, merge in gpu.runs_cases(runs, m):
    grid = gpu.sweep_grid(dataclasses.replace(config, clients=clients),
                          list(range(s)), dataset, merge, algorithm)
    args = (grid.values, grid.template(), grid.feds, grid.seeds, jnp.int32(0))
    out[f"{algorithm} {layout} ({s} x {clients})"] = (grid.programs.round, args)
  return out


def h100_device() -> Any:
  """A compile-only H100 SXM (`H100_SXM`) from jax's CUDA plugin; no GPU needed."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100_SXM,
                                            topology="1x1x1")
  except (NotImplementedError, RuntimeError) as error:
    raise SystemExit(
        "--target h100 needs jax's CUDA plugin for this jax "
        f"({jax.__version__}): pip install \"jax[cuda12]=={jax.__version__}\" "
        f"(a GPU is not needed). JAX said: {error}") from error
  return topology.devices[0]


def compiled_text(fn: Any, args: tuple[Any, ...], device: Any | None) -> str:
  """Optimized HLO of `fn(*args)` for the default backend, or for `device` (compile-only)."""
  if device is None:
    return jax.jit(fn).lower(*args).compile().as_text()
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype,
                                                         sharding=sharding), args)
  lowered = jax.jit(fn).trace(*abstract).lower(lowering_platforms=("cuda",))
  return lowered.compile().as_text()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=int, nargs="+", default=[8])
  parser.add_argument("--models", nargs="+", default=["mlp", "cnn"],
                      choices=sorted(gpu.INPUT_SHAPES))
  parser.add_argument("--target", choices=TARGETS, default="backend",
                      help="compile for the default backend, or for an H100 (no GPU "
                           "needed; jax's CUDA plugin does)")
  parser.add_argument("--precision", choices=gpu.train.PRECISIONS, default="float32",
                      help="pflax's compute precision (the plain vmap's is float32)")
  parser.add_argument("--runs", type=int, default=None,
                      help="vmap pflax's trainers over this many runs of M clients (a "
                           "sweep's layout); the plain vmap trains their runs x M clients")
  parser.add_argument("--round", nargs="+", default=None, metavar="ALGORITHM",
                      help="compile these algorithms' sweep rounds (the CNN, --runs "
                           "seeds of M clients) in both client layouts instead")
  parser.add_argument("--dump", default=None, help="also write each program's HLO here")
  args = parser.parse_args()
  if args.target == "h100":
    jax.config.update("jax_platforms", "cpu")  # the plugin compiles; nothing runs
  device = h100_device() if args.target == "h100" else None
  where = "an H100 SXM (compile-only)" if device else f"backend {jax.default_backend()}"
  print(f"{where}, jax {jax.__version__}, rolled loop, pflax in {args.precision}\n")
  print("| model | M | program | kernels per step | MB per step | vs baseline | "
        + " | ".join(PROGRAM_OPS) + " |")
  print("|---|---:|---|---:|---:|---:|" + "---:|" * len(PROGRAM_OPS))
  cases = ([(f"{a} round", m, round_programs(a, m, args.runs)) for a in args.round
            for m in args.clients] if args.round else
           [(model_name, m, programs(model_name, m, args.precision, args.runs))
            for model_name in args.models for m in args.clients])
  for model_name, m, compiled in cases:
    rows = {}
    for name, (fn, fn_args) in compiled.items():
      hlo = compiled_text(fn, fn_args, device)
      if args.dump:
        path = pathlib.Path(args.dump) / f"{model_name}_{m}_{name.replace(' ', '_')}.hlo"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(hlo)
      rows[name] = (step_traffic(hlo), _ops(hlo))
    base = list(rows.values())[-1][0][1]  # the baseline, last
    for name, ((kernels, traffic), whole) in rows.items():
      print(f"| {model_name} | {m} | {name} | {kernels} | {traffic / 1e6:,.1f} | "
            f"{traffic / base:.2f}x | "
            + " | ".join(str(whole[op]) for op in PROGRAM_OPS) + " |")

if __name__ == "__main__":
  main()
