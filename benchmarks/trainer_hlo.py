"""Counts the HLO instructions of pflax's trainers and of the plain-vmap reference.

Each program (`make_trainer(strategy="vmap")`, `make_trainer(strategy="steps")`
and `gpu.plain_vmap`, one epoch of 100 samples per client in batches of 10, SGD)
is compiled for the default backend with a rolled loop (`unroll=False`, what a
GPU gets by default) and its optimized HLO read: the whole program's gathers,
scatters, while loops, sorts, dynamic slices, selects and copies, and the
fusions, copies, dots and convolutions of the training loop's body (the
computation with the most fusions), i.e. the kernels of one local step.

Usage:
  python benchmarks/trainer_hlo.py                  # M = 8, the MLP and the CNN
  python benchmarks/trainer_hlo.py --clients 100 --models cnn --dump DIR
"""

import argparse
import collections
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("gpu", ROOT / "benchmarks" / "gpu.py")
gpu = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu)

PROGRAM_OPS = ("while", "gather", "scatter", "sort", "dynamic-slice",
               "dynamic-update-slice", "select", "copy", "conditional")
BODY_OPS = ("fusion", "copy", "dot", "convolution")


def _ops(text: str) -> collections.Counter:
  return collections.Counter(re.findall(r" = .*? ([a-z][a-z0-9\-]*)\(", text))


def _loop_body(hlo: str) -> collections.Counter:
  """Instructions of the non-fused computation with the most fusions."""
  computations = re.split(r"\n(?=\S.*\{\s*$)", hlo, flags=re.M)
  bodies = [_ops(c) for c in computations if not c.lstrip().startswith("%fused")]
  return max(bodies, key=lambda ops: ops["fusion"])


def programs(model_name: str, m: int) -> dict[str, tuple[object, tuple[object, ...]]]:
  """`{name: (jitted function, arguments)}` of the three programs."""
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
                                               unroll=False), trainer_args)
         for s in ("vmap", "steps")}
  steps_first = gpu._steps_first  # pylint: disable=protected-access
  out[gpu.BASELINE] = (gpu.plain_vmap(model, gpu.LR),
                       (stacked, steps_first(x, sizes.batch), steps_first(y, sizes.batch)))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=int, default=8)
  parser.add_argument("--models", nargs="+", default=["mlp", "cnn"],
                      choices=sorted(gpu.INPUT_SHAPES))
  parser.add_argument("--dump", default=None, help="also write each program's HLO here")
  args = parser.parse_args()
  print(f"backend {jax.default_backend()}, M = {args.clients}, rolled loop\n")
  print("| model | program | " + " | ".join(PROGRAM_OPS) + " | loop body: "
        + ", ".join(BODY_OPS) + " |")
  print("|---|---|" + "---:|" * (len(PROGRAM_OPS) + 1))
  for model_name in args.models:
    for name, (fn, fn_args) in programs(model_name, args.clients).items():
      hlo = jax.jit(fn).lower(*fn_args).compile().as_text()
      if args.dump:
        path = pathlib.Path(args.dump) / f"{model_name}_{name.replace(' ', '_')}.hlo"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(hlo)
      whole, body = _ops(hlo), _loop_body(hlo)
      print(f"| {model_name} | {name} | "
            + " | ".join(str(whole[op]) for op in PROGRAM_OPS) + " | "
            + ", ".join(str(body[op]) for op in BODY_OPS) + " |")


if __name__ == "__main__":
  main()
