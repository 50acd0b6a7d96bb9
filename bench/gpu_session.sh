#!/usr/bin/env bash
# Everything that must be re-checked on the H200 after kernel changes, in one device call (about 8 minutes):
#   bash bench/gpu_session.sh            (from the repository root; logs under $OUT, or ./gpu-logs)
#   SKIP_BENCH=1 bash bench/gpu_session.sh   leaves out the full benchmark (about 4 minutes)
# Prints a short summary last; full logs are in the log folder.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FA_VARIANTS_CACHE=${FA_VARIANTS_CACHE:-/tmp/favc} OPENBLAS_NUM_THREADS=8
log=${OUT:-gpu-logs}; mkdir -p "$log"
S=fp16-d64-N67-B2-H3-causal,fp16-d64-N67-B2-H3-full,bf16-d128-N67-B2-H3-causal,bf16-d128-N67-B2-H3-full
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}  # COMMIT=...: the device copy may carry stale git metadata
echo "commit $commit" > "$log/gputests.log"
timeout 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider >> "$log/gputests.log" 2>&1
: > "$log/sanitizers.log"
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool python3 bench/profile_one.py fa1,fa2,fa2_fp8 $S --calls 1 \
    >> "$log/sanitizers.log" 2>&1
done
timeout 60 python3 bench/devcheck.py --memory --quant --variants fa2 > "$log/memory_quant.log" 2>&1
timeout 180 python3 bench/devcheck.py --fp8 > "$log/fp8_speed.log" 2>&1
timeout 240 python3 -m fa_variants.fp8_study --gpu > "$log/fp8_study.log" 2>&1
timeout 120 python3 -m fa_variants.fp8_study --accumulation --gpu >> "$log/fp8_study.log" 2>&1
timeout 90 ncu --clock-control none -k regex:"quantize|channel_amax" --launch-skip 4 --launch-count 4 --section SpeedOfLight \
  python3 bench/profile_one.py fa2_fp8 bf16-d128-N4096-B4-H16-full --calls 2 > "$log/ncu_quant.log" 2>&1
[ -n "${SKIP_BENCH:-}" ] || timeout 270 python3 -m pytest bench -q -p no:cacheprovider --benchmark-json="$log/bench.json" > "$log/bench.log" 2>&1
# The summary, longest first, so that a truncated tail still shows the pass/fail lines (at most 8 log files).
grep -E "^\| " "$log/bench.log" 2>/dev/null | head -60
grep -E "^(inputs|normal|outliers|sink|----|what|model|GPU)" "$log/fp8_study.log"
grep -E "^  [a-z_]+<|DRAM Throughput|Duration" "$log/ncu_quant.log"
grep -v '^\[' "$log/fp8_speed.log" | tail -8
grep -A6 "quantize ms" "$log/memory_quant.log"
echo "== commit $commit"
tail -1 "$log/gputests.log"
grep -h "SUMMARY" "$log/sanitizers.log"
