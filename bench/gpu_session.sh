#!/usr/bin/env bash
# Everything that must be re-checked on the H200 after kernel changes, in one device call of at most BUDGET_S
# seconds (default 540, inside the device's 10-minute limit per command):
#   bash bench/gpu_session.sh            (from the repository root; logs under $OUT, or ./gpu-logs)
#   SKIP_BENCH=1 bash bench/gpu_session.sh              leaves out the full benchmark and its plot
#   STEPS="launch_cost headdims bench plot" bash bench/gpu_session.sh    only the named steps
#   STEPS="fp8_speed fp8_study fp8_accum ncu_quant" bash bench/gpu_session.sh
#   STEPS="gputests fa3_matrix ablation bwd_sweep" bash bench/gpu_session.sh        the fa3 and backward work
#   STEPS="fp8_matrix" bash bench/gpu_session.sh                                    fa3_fp8 beside the rest
# Steps run in the order below (most needed first); a step that would start with less than 30 s of the budget
# left is skipped and listed as such, so the session always ends with every file it wrote. Each step's time and
# exit status are in the summary. Files (the device returns at most 8):
#   checks.log  GPU tests, sanitizers, memory/quantizer checks     perf.log  launch cost, head dims, pytest bench, plot
#   fp8.log     fp8 speed, fp8 study, ncu of the quantizers       bench.json, launch_cost.json, headdims.json, tflops.png
# Prints a short summary last (its tail, the pass/fail lines, survives truncation).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FA_VARIANTS_CACHE=${FA_VARIANTS_CACHE:-/tmp/favc} OPENBLAS_NUM_THREADS=8
log=${OUT:-gpu-logs}; mkdir -p "$log"
tmp=$(mktemp -d)                       # one log per step, for the summary; $log gets them combined
budget=${BUDGET_S:-540}; t_start=$SECONDS
S=fp16-d64-N67-B2-H3-causal,fp16-d64-N67-B2-H3-full,bf16-d128-N67-B2-H3-causal,bf16-d128-N67-B2-H3-full
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}  # COMMIT=...: the device copy may carry stale git metadata
for f in checks perf fp8; do echo "commit $commit" > "$log/$f.log"; done
: > "$tmp/times"

want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }

# step NAME LOG MAX_S CMD...: run CMD under a timeout of MAX_S (or what is left of the budget, if less); its
# output goes to $tmp/NAME.log and is appended to $log/LOG under a header with its exit status and duration.
step() {
  local name=$1 dest=$2 max=$3; shift 3
  want "$name" || return 0
  local left=$(( budget - (SECONDS - t_start) ))
  if (( left < 30 )); then
    echo "$name: skipped, ${left} s of the ${budget} s budget left" | tee -a "$log/$dest" >> "$tmp/times"
    return 0
  fi
  local t0=$SECONDS rc
  timeout $(( max < left ? max : left )) "$@" > "$tmp/$name.log" 2>&1
  rc=$?
  { echo "==== $name: rc $rc, $(( SECONDS - t0 )) s: $*"; cat "$tmp/$name.log"; echo; } >> "$log/$dest"
  echo "$name: rc $rc, $(( SECONDS - t0 )) s" >> "$tmp/times"
}

# Every instance compiled in parallel into the cache first (the tests and benchmarks would otherwise compile them one
# at a time, on first use: minutes of device time)
step build checks.log 240 python3 -m fa_variants.cli build --arch 90a
step gputests checks.log 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider
for tool in memcheck racecheck synccheck; do
  step $tool checks.log 120 compute-sanitizer --tool $tool python3 bench/profile_one.py fa1,fa2,fa2_fp8,fa3,fa3_fp8 $S --calls 1
done
# fa3 (issue 9): the 60-shape matrix beside fa2 and both torch backends, and the FA3 paper's ablation
step fa3_matrix perf.log 120 python3 bench/devcheck.py --time fa3 --variants fa2,fa3 --repeats 10
step ablation perf.log 90 python3 bench/ablation.py --seqlen 4096 8192
# the fp8 variants (fa2_fp8, fa3_fp8) pre-quantized and quantizing, beside fa2, fa3 and torch on the bf16 matrix
step fp8_matrix perf.log 150 python3 bench/devcheck.py --fp8-matrix fa3_bf16 --variants fa2,fa3,fa2_fp8,fa3_fp8 --repeats 10
# the backward (issue 8): tile candidates of the wgmma backward against torch's flash and cuDNN backwards
step bwd_sweep perf.log 150 python3 bench/bwd_sweep.py --json "$log/bwd_sweep.json"
step memory_quant checks.log 60 python3 bench/devcheck.py --memory --quant --variants fa2
step launch_cost perf.log 60 python3 bench/launch_cost.py --repeats 5 --calls 2000 --json "$log/launch_cost.json"
if [ -z "${SKIP_BENCH:-}" ]; then   # before headdims: the bench writes its JSON only at the end, headdims row by row
  step bench perf.log 360 env FAV_BENCH_DIRECTIONS=${FAV_BENCH_DIRECTIONS:-fwd} \
    python3 -m pytest bench -q -p no:cacheprovider --benchmark-json="$log/bench.json"   # forward only by default
  step plot perf.log 60 python3 bench/plot.py "$log/bench.json" -o "$log/tflops.png"
fi
step headdims perf.log 200 python3 bench/headdims.py --repeats 10 --json "$log/headdims.json"
step fp8_speed fp8.log 180 python3 bench/devcheck.py --fp8
step fp8_study fp8.log 240 python3 -m fa_variants.fp8_study --gpu
step fp8_accum fp8.log 120 python3 -m fa_variants.fp8_study --accumulation --gpu
step ncu_quant fp8.log 90 ncu --clock-control none -k regex:"quantize|channel_amax" --launch-skip 4 --launch-count 4 \
  --section SpeedOfLight python3 bench/profile_one.py fa2_fp8 bf16-d128-N4096-B4-H16-full --calls 2

# The summary, longest first, so that a truncated tail still shows the pass/fail lines.
show() { [ -f "$tmp/$1.log" ] && cat "$tmp/$1.log"; }
show bench | sed -n '/fa2 against torch SDPA/,/^[^|]/p'
show headdims | grep -E '^(\||padded)'
show fp8_study | grep -E "^(inputs|normal|outliers|sink|----|what|model|GPU)"
show fp8_accum | grep -E "^(inputs|normal|outliers|sink|----|what|model|GPU)"
show ncu_quant | grep -E "^  [a-z_]+<|DRAM Throughput|Duration"
show fp8_speed | grep -v '^\[' | tail -8
show memory_quant | grep -A6 "quantize ms"
show launch_cost | grep -E '^(\||per-call)'
show fa3_matrix | tail -62
show fp8_matrix | tail -32
show ablation
show bwd_sweep | grep -E '^(best|wall)'
show plot
echo "== steps ($(( SECONDS - t_start )) s of ${budget} s)"; cat "$tmp/times"
echo "== commit $commit"
show gputests | tail -1
show memcheck | grep -h "SUMMARY"
show racecheck | grep -h "SUMMARY"
show synccheck | grep -h "SUMMARY"
rm -rf "$tmp"
