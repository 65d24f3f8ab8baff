#!/usr/bin/env bash
# W3 on this CPU with Poisson arrivals, without and with --max-step-latency-ms, one after the
# other in one command (results: bench/results/cpu-w3-step-latency-{off,on}.json).
#   bash scripts/bench_step_latency_cpu.sh [RATE req/s] [TARGET ms]
set -eu
rate=${1:-0.3}; target=${2:-150}
.venv/bin/loom bench --workloads W3 --request-rate "$rate" --out bench/results/cpu-w3-step-latency-off.json
.venv/bin/loom bench --workloads W3 --request-rate "$rate" --max-step-latency-ms "$target" \
  --out bench/results/cpu-w3-step-latency-on.json
