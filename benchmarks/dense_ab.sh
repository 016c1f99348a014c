#!/bin/bash
# The H200 A/B of the decode-kernel switches (DSV41_FP8_DECODE, DSV41_MHC_COEF, DSV41_MOE_ROUTE),
# run from the repository root of a copy of the tree (it removes the copy's dsv41/ stub so that the
# namespace comes from the PYTHONPATH mapping below). Phase 1 checks every variant against the
# reference and compiles its kernels in AB_PARTS processes at once, beside the GPU-marked tests of
# the new kernels; phase 2 times everything in one process (warm Triton cache) and prints the
# tables and the DENSE7_ENV line. Logs under $OUT. About 100-150 s on a warm H200.
set -o pipefail
start=$SECONDS
mkdir -p /tmp/pkg/dsv41 && cp dsv41/__init__.py /tmp/pkg/dsv41/
for d in core backends npu_ops graphs deploy; do ln -sfn "$PWD/$d" "/tmp/pkg/dsv41/$d"; done
rm -rf dsv41
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dense_ab}
mkdir -p "$OUT"
parts=${AB_PARTS:-12}
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for i in $(seq 0 $((parts - 1))); do
  (cd benchmarks && timeout "${AB_WARM_S:-90}" python3 dense_ab.py --warm --part "$i/$parts" > "$OUT/warm_$i.log" 2>&1) &
done
# the GPU-marked tests of the new kernels, cut at the same time limit (see the PASSED / FAILED counts)
(DSV41_STRICT=1 timeout "${AB_WARM_S:-90}" python3 -m pytest -v -m gpu -p no:cacheprovider \
  tests/test_triton_block_linear.py -k "fp8_mma or xscale or every_code" > "$OUT/gpu_tests_linear.log" 2>&1) &
(DSV41_STRICT=1 timeout "${AB_WARM_S:-90}" python3 -m pytest -v -m gpu -p no:cacheprovider \
  tests/test_triton_moe_route.py tests/test_triton_mega_mhc.py -k "small_kernel or coef_modes" \
  > "$OUT/gpu_tests_route_mhc.log" 2>&1) &
wait
echo "phase 1 (checks, compiles, GPU tests): $((SECONDS - start)) s"
grep -h "CHECK FAILED\|warm part\|Error" "$OUT"/warm_*.log | sort | uniq | head -40
for f in "$OUT"/gpu_tests_*.log; do
  echo "$(basename "$f"): $(grep -c PASSED "$f") passed, $(grep -c FAILED "$f") failed"
  grep FAILED "$f" | head -10
done
(cd benchmarks && timeout "${AB_TIME_S:-100}" python3 dense_ab.py 2>&1 | grep -v Warning | tee "$OUT/ab.log")
echo "dense_ab.sh: $((SECONDS - start)) s in all"
