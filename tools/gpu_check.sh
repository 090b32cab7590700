#!/usr/bin/env bash
# Everything chapter 05 needs a GPU for, in one command: the Triton kernel tests compiled (the gpu-marked ones too) and
# the kernel lab's benchmarks. Written for a lent GPU machine (the `device` tool): it has torch, triton, transformers,
# pytest and hypothesis but no internet, so nothing is installed and minfer runs from this checkout.
#
#   bash tools/gpu_check.sh        # results in $OUT (the device tool's folder), else ./gpu-results
#
# tests/test_cuda_engine.py needs only the default model's tokenizer files (carry data/models/smollm2-135m-instruct/
# tokenizer.json and tokenizer_config.json; benchmarks/bench_cuda.py its config.json too). `from minfer import LLM`
# loads every chapter, and the GPU image lacks some of their pure-Python dependencies (fastcore, fastapi and its
# dependencies, uvicorn, gguf, llguidance): carry them as wheels (the device tool's README says how). The one test that needs the real model (Triton vs PyTorch greedy tokens)
# runs only if data/models/ holds the converted default model; it does not travel in one call (the GGUF is 94 MB), so
# without it that test is deselected.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-gpu-results}"; mkdir -p "$out"
py="${PYTHON:-python3}"
status=0

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} | tee "$out/device.txt"

select=()
[ -f data/models/smollm2-135m-instruct/model.safetensors ] || select=(-k "not greedy_tokens")
"$py" -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_cuda_engine.py "${select[@]}" 2>&1 | tee "$out/test_flash.txt" || status=1

for f in kernels/*.py; do
    echo "== $f"
    "$py" "$f" 2>&1 | tee "$out/$(basename "$f" .py).txt" || status=1
done
# the engine end to end: random weights of the default model's shape, so only its config and tokenizer files travel
echo "== benchmarks/bench_cuda.py"
"$py" benchmarks/bench_cuda.py --out "$out/bench_cuda.txt" 2>&1 | grep -v -E "Loading|Writing|prompts:" || status=1
exit $status
