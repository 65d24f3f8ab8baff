#!/usr/bin/env bash
# Old code against new code on the same GPU, alternating, each run its own process (the device
# tool's machine: run from the repository root with .whl/ carried). Prepare the old code with
#   git archive --format=tar.gz -o .whl/old-SHA.tar.gz SHA
# and put the missing wheels in .whl/ (docs/benchmarks.md lists them). Usage:
#   bash scripts/bench_old_new_gpu.sh SHA TAG [WORKLOADS] [MODEL]   (results: $OUT/gpu-MODEL-TAG-{old,new}-N.json)
set -u
old=${1:?old commit}; tag=${2:?a name for the results}; workloads=${3:-W1,W2}; model=${4:-random:llama-8b}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/loomsite . clients/python || exit 1
mkdir -p /tmp/old && tar xzf ".whl/old-$old.tar.gz" -C /tmp/old
(cd /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite . clients/python) || exit 1
cd /tmp
for run in old-1 new-1 old-2 new-2; do
  case $run in old*) site=/tmp/oldsite;; *) site=/tmp/loomsite;; esac
  PYTHONPATH=/tmp/site:$site timeout 170 python3 -m loom.cli bench --workloads "$workloads" --model-id "$model" \
    --device cuda --dtype bfloat16 --out "$OUT/gpu-${model#random:}-$tag-$run.json" 2>&1 | grep -E "^W[0-9]:" || exit 1
done
