"""``loom quantize``: making GPTQ, AWQ, RTN, FP8 and NF4 checkpoints from a dense model.

- ``calibration``: the shipped calibration text, tokenized into windows;
- ``group_quant``: per-group integer quantization (scales, zero points, round to nearest);
- ``gptq_solver``: GPTQ's error-compensating column-by-column quantization from a Hessian;
- ``awq_search``: AWQ's activation-aware per-channel scale search and folding;
- ``pipeline``: the model layer by layer over the calibration activations;
- ``writers``: the checkpoint formats (GPTQ v1, AWQ GEMM, compressed-tensors FP8, bitsandbytes NF4);
- ``command``: the CLI.
"""
