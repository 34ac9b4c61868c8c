#!/usr/bin/env bash
# Issue 30's GPU measurements in one call of a lent GPU, inside a time budget.
#
# A lent GPU comes with 15 minutes of device time in all (its start included) and
# 10 minutes a command, and the whole `benchmarks/gpu.py` needs more than that. This
# runs it with its sections in the order of what they decide (the trainer, the
# main job, the leaderboard, the runs, the aggregators) under `--budget`, writing
# its report after every section, then reads the programs XLA-GPU autotuned
# (`benchmarks/trainer_hlo.py`) with the time left. Every file lands in $OUT as
# soon as it exists, so a call stopped at its limit still brings back what ran.
#
# The device machine has jax, flax, optax, chex, scikit-learn and torch, but no
# Fashion-MNIST and no network: it travels with the checkout (30 MB of the 64 MiB
# a call may carry). Here, once:
#   echo /.fmnist/ >> .git/info/exclude
#   mkdir -p .fmnist && cp /usr/share/datasets/fashion-mnist/*.gz .fmnist/
# then one device run, carry [".fmnist"], timeout_s 600:
#   bash benchmarks/gpu_device.sh
# Files back: gpu.md, trainer_hlo.md, trainer_hlo_rounds.md, hlo.tgz (the
# optimized HLO of every trainer_hlo.py program) and gpu_device.log.
#
# Arguments are added to gpu.py's (a test: `--quick --sections main`).
# Environment: OUT (default /tmp/pflax-gpu), GPU_BUDGET (seconds for everything,
# default 540), PYTHON (default python3), TRAINER_HLO_CLIENTS (default
# "20 100 1000").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/pflax-gpu}
budget=${GPU_BUDGET:-540}
python=${PYTHON:-python3}
clients=${TRAINER_HLO_CLIENTS:-20 100 1000}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
log="$out/gpu_device.log"
hlo=$(mktemp -d)
data=()
[ -d .fmnist ] && data=(--data-dir .fmnist)
left() { echo $((budget - SECONDS)); }

# Runs "$@" into the file $2 for the seconds left, or says there were none.
for_the_rest() {
  local name=$1 file=$2
  shift 2
  if [ "$(left)" -le 10 ]; then
    echo "$name: not run, the budget was spent" | tee -a "$log"
    return
  fi
  timeout "$(left)" "$@" >"$file" 2>>"$log"
  echo "$name: exit $?, at $SECONDS s" | tee -a "$log"
}

{ nvidia-smi || true; "$python" -c 'import jax; print(jax.__version__, jax.devices())'; } \
  >"$log" 2>&1
# gpu.py stops starting work at 80% of the budget; a case under way may run on
# (a compilation, a round), and trainer_hlo.py gets what remains.
# Its output goes to the log and to the call's output too.
"$python" benchmarks/gpu.py --budget $((budget * 4 / 5)) "${data[@]}" \
  --sections training main leaderboard runs aggregators --out "$out/gpu.md" "$@" \
  2>&1 | tee -a "$log"
echo "gpu.py: exit ${PIPESTATUS[0]}, at $SECONDS s" | tee -a "$log"
# shellcheck disable=SC2086  # the clients are several words
for_the_rest trainer_hlo.py "$out/trainer_hlo.md" "$python" benchmarks/trainer_hlo.py \
  --clients $clients --dump "$hlo"
for_the_rest "trainer_hlo.py --round" "$out/trainer_hlo_rounds.md" "$python" \
  benchmarks/trainer_hlo.py --clients 20 --round fedavg ditto
tar czf "$out/hlo.tgz" -C "$hlo" .
