"""Test configuration shared by the whole suite."""

# Hypothesis profiles (tests/test_properties.py). The default run is bounded and
# deterministic (the same examples every run, so it cannot flake); CI's slow
# pass sets HYPOTHESIS_PROFILE=ci for a twice larger search (also
# derandomized, so that CI cannot fail on a draw nobody has seen before).
import os

# Flower (tests/test_flower*.py) sends telemetry and checks for updates unless
# told not to: no test may reach the network.
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"

import atexit
import shutil
import tempfile

import jax
import pytest
from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import settings

from pflax._src.cli import runtime

# JAX's persistent compilation cache, in a folder of this test process's own, on
# from the first test: programs that a module compiled and `jax.clear_caches` then
# dropped (below) are read back by the later modules that compile them again. The
# user's cache (`~/.cache/pflax/jax`) is never read or filled: in-process runs of
# `pflax-run` find this one configured, and those in subprocesses its folder in
# PFLAX_CACHE_DIR.
_CACHE = tempfile.mkdtemp(prefix="pflax-tests-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["PFLAX_CACHE_DIR"] = _CACHE
runtime.cache_compilations_in(_CACHE)

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
_PHASES = [Phase.explicit, Phase.generate, Phase.shrink]   # explain: minutes
settings.register_profile(
    "pflax", max_examples=6, deadline=None, derandomize=True, database=None,
    phases=_PHASES, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, database=None,
    print_blob=True,
    phases=_PHASES, suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "pflax"))


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilation_caches():
  """Each test module ends by dropping the programs it compiled.

  XLA-CPU maps the code of every compiled program into memory (three mappings
  each). The whole suite compiles tens of thousands of programs in one process,
  which would pass the kernel's limit on a process's mappings (vm.max_map_count,
  65,530 by default) and end the run in a segmentation fault.
  """
  yield
  jax.clear_caches()
