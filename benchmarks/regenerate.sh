#!/usr/bin/env bash
# Regenerates every committed benchmark table and plot in benchmarks/results/.
# Hours on a 2-core CPU; run it on a quiet machine (timings are ratios to
# baselines measured in the same run, but load still adds noise).
#   bash benchmarks/regenerate.sh            # everything
#   bash benchmarks/regenerate.sh --quick    # smoke run of every script (minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
results=benchmarks/results
mkdir -p "$results"
if [[ "${1:-}" == "--quick" ]]; then
  python benchmarks/aggregators.py --quick
  python benchmarks/scaling.py --quick
  python benchmarks/training.py --quick
  python benchmarks/sweeps.py --quick
  python benchmarks/many_clients.py --quick
  python benchmarks/reproduce.py --quick
  python benchmarks/reproduce_fmnist.py --quick
  python benchmarks/cwfedavg_partial.py --rounds 2 --out /tmp/cwfedavg_partial_quick.md
  python benchmarks/robust.py --rounds 2 --seeds 0
  python benchmarks/flower_traffic.py --quick
  python benchmarks/tune.py --quick --out /tmp/tune_quick.json
  exit 0
fi
python benchmarks/aggregators.py | tee "$results/aggregators.md"
python benchmarks/scaling.py                      # scaling.md, scaling_*.png, memory_cwfedavg.png
python benchmarks/training.py --out "$results/training.md"
python benchmarks/training.py --clients 10 20 50 100 200 500 1000 --impls "pflax auto" "jax loop" \
  --repeats 2 --rounds 2 --budget 60 --out "$results/training_scaling.md" \
  --plot "$results/training_scaling.png"
python benchmarks/sweeps.py --out "$results/sweeps.md"
python benchmarks/many_clients.py | tee "$results/many_clients.md"
python benchmarks/reproduce.py                    # reproduction.md, reproduction-*.json, reproduction.png
python benchmarks/reproduce_fmnist.py --size cpu  # reproduction_fmnist.md (Fashion-MNIST: apt-get install dataset-fashion-mnist)
python benchmarks/cwfedavg_partial.py             # cwfedavg_partial.md (about 50 min)
python benchmarks/fedclassavg_ablation.py --model mlp --train 4000 --test 2000 --rounds 40  # fedclassavg_fmnist.md
python benchmarks/robust.py                       # robust.md
python benchmarks/flower_traffic.py --out "$results/flower_traffic.md"
python benchmarks/tune.py                         # tune.json, tune.png, the table of tune.md (about 30 min)
