#!/usr/bin/env bash
# The GPU checks of one session, as one script (about 6 minutes on an H200; see docs/benchmarks.md):
# CUDA correctness tests, the draft-block kernel benchmark and the reference runtime on CUDA.
# Runs under the host's own python3/torch/triton; Python wheels missing there may be put in .whl/.
# Usage: OUT=results-dir bash benchmarks/gpu_checks.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# Editable: cli/ and plugins/ map into the package through setuptools' editable finder.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1

timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --durations=8 tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
timeout 220 python3 benchmarks/bench_draft_block.py --json "$OUT/bench_draft_block.json" 2>&1 | tee "$OUT/bench_draft_block.log"
# two rows more than before (n-gram and dflash-sa with 15 drafts), so two prompts fewer, in the same time
timeout 110 python3 benchmarks/bench_reference_runtime.py --device cuda --prompts 6 --max-tokens 96 --repeats 2 \
  --sa-max-drafts 15 2>&1 | tee "$OUT/bench_reference_runtime.log"
timeout 40 python3 -c "from trtllm_dflash.cli.run import main; main()" --device cuda --max-tokens 48 --baseline \
  2>&1 | tee "$OUT/dflash_run_cuda.log"
