"""benchmarks/trainer_hlo.py: the loop body's kernels and the bytes they move."""

import importlib.util
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODULE = """HloModule jit_epoch

%fused_gather (param_0: f32[100,8], param_1: s32[4,1]) -> f32[4,8] {
  %param_0 = f32[100,8]{1,0} parameter(0)
  %param_1 = s32[4,1]{1,0} parameter(1)
  ROOT %gather.1 = f32[4,8]{1,0} gather(%param_0, %param_1), offset_dims={1}
}

%fused_subtract (param_0.1: f32[8,3], param_1.1: f32[8,3]) -> f32[8,3] {
  %param_0.1 = f32[8,3]{1,0} parameter(0)
  %param_1.1 = f32[8,3]{1,0} parameter(1)
  ROOT %subtract.1 = f32[8,3]{1,0} subtract(%param_0.1, %param_1.1)
}

%body (arg: (s32[], f32[8,3], f32[100,8], s32[4,1])) -> (s32[], f32[8,3], f32[100,8], s32[4,1]) {
  %arg = (s32[], f32[8,3]{1,0}, f32[100,8]{1,0}, s32[4,1]{1,0}) parameter(0)
  %w = f32[8,3]{1,0} get-tuple-element(%arg), index=1
  %data = f32[100,8]{1,0} get-tuple-element(%arg), index=2
  %idx = s32[4,1]{1,0} get-tuple-element(%arg), index=3
  %batch = f32[4,8]{1,0} fusion(%data, %idx), kind=kLoop, calls=%fused_gather
  %g = f32[8,3]{1,0} custom-call(%batch), custom_call_target="grad"
  %new = f32[8,3]{1,0} fusion(%w, %g, %w), kind=kLoop, calls=%fused_subtract
  %i = s32[] get-tuple-element(%arg), index=0
  ROOT %out = (s32[], f32[8,3]{1,0}, f32[100,8]{1,0}, s32[4,1]{1,0}) tuple(%i, %new, %data, %idx)
}

%cond (arg.1: (s32[], f32[8,3], f32[100,8], s32[4,1])) -> pred[] {
  %arg.1 = (s32[], f32[8,3]{1,0}, f32[100,8]{1,0}, s32[4,1]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%fused_add (param_0.2: f32[8,3]) -> f32[8,3] {
  %param_0.2 = f32[8,3]{1,0} parameter(0)
  ROOT %add.1 = f32[8,3]{1,0} add(%param_0.2, %param_0.2)
}

ENTRY %main (init: (s32[], f32[8,3], f32[100,8], s32[4,1])) -> f32[8,3] {
  %init = (s32[], f32[8,3]{1,0}, f32[100,8]{1,0}, s32[4,1]{1,0}) parameter(0)
  %loop = (s32[], f32[8,3]{1,0}, f32[100,8]{1,0}, s32[4,1]{1,0}) while(%init), condition=%cond, body=%body
  %w.2 = f32[8,3]{1,0} get-tuple-element(%loop), index=1
  %twice = f32[8,3]{1,0} fusion(%w.2), kind=kLoop, calls=%fused_add
  %thrice = f32[8,3]{1,0} fusion(%twice), kind=kLoop, calls=%fused_add
  ROOT %copy = f32[8,3]{1,0} copy(%thrice)
}
"""


@pytest.fixture(scope="module")
def trainer_hlo():
  spec = importlib.util.spec_from_file_location(
      "trainer_hlo", ROOT / "benchmarks" / "trainer_hlo.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_shape_bytes_sums_tuples_and_ignores_layouts(trainer_hlo):
  assert trainer_hlo.shape_bytes("(f32[2,3]{1,0}, pred[])") == 25
  assert trainer_hlo.shape_bytes("bf16[10,4]{0,1}") == 80
  assert trainer_hlo.shape_bytes("(f32[1,5,5,32000]{3,2,1,0}, u8[0]{0})") == 3_200_000


def test_step_traffic_reads_the_loop_body(trainer_hlo):
  # Only the while loop's body counts, not the entry's kernels (more fusions).
  kernels, traffic = trainer_hlo.step_traffic(MODULE)
  # The gather writes 4 x 8 floats and reads as many of its 100 x 8 operand,
  # plus its 4 indices; the library call reads the batch and writes 8 x 3; the
  # update reads w (passed twice, read once) and g and writes 8 x 3.
  gather = 128 + 128 + 16
  call = 128 + 96
  update = 96 + 96 + 96
  assert (kernels, traffic) == (3, gather + call + update)


def test_cpu_programs_move_at_least_their_weights_each_step(trainer_hlo):
  programs = trainer_hlo.programs("mlp", 2)
  assert set(programs) == {"pflax vmap", "pflax steps", trainer_hlo.gpu.BASELINE}
  for fn, args in programs.values():
    weights = sum(a.nbytes for a in jax.tree.leaves(args[0]))
    kernels, traffic = trainer_hlo.step_traffic(trainer_hlo.compiled_text(fn, args, None))
    assert kernels > 0
    assert traffic >= 2 * weights  # every weight read and written


def _cuda_plugin_installed() -> bool:
  try:
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
  except ModuleNotFoundError:
    return False


@pytest.mark.skipif(_cuda_plugin_installed(), reason="jax's CUDA plugin is installed")
def test_h100_target_without_the_cuda_plugin_says_what_to_install(trainer_hlo):
  with pytest.raises(SystemExit, match=r"jax\[cuda12\]"):
    trainer_hlo.h100_device()
