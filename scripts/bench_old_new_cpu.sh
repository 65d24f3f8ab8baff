#!/usr/bin/env bash
# Old code against new code on this CPU, alternating, Loom only (the peer's figures do not
# depend on Loom's code): OLD_VENV is a venv with the old commit installed (e.g. `git worktree
# add --detach /tmp/old SHA && make -C /tmp/old install`, then OLD_VENV=/tmp/old/.venv).
#   OLD_VENV=... bash scripts/bench_old_new_cpu.sh TAG [WORKLOADS]   (results: bench/results/cpu-TAG-{old,new}-N.json)
set -u
tag=${1:?a name for the results}; workloads=${2:-C0,C1,C2}
for run in old-1 new-1 old-2 new-2; do
  case $run in old*) loom=${OLD_VENV:?}/bin/loom;; *) loom=.venv/bin/loom;; esac
  $loom bench --workloads "$workloads" --out "bench/results/cpu-$tag-$run.json" 2>&1 | grep -E "^C[0-9]:" || exit 1
done
