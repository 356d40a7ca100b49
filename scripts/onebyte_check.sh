#!/usr/bin/env bash
# One device call (<= 9.5 min on an H200). Default: sweep the 1-byte kernels (semantic/kernels/tune_onebyte.py:
# conversion routes x tiles, GEMVs and chained tails, <= 225 s), bench bf16/fp8/int8 with the table it wrote, then the
# 1-byte GPU tests with that table as this GPU's packaged one (the device's copy of the checkout only).
# SWEEP=grid: sweep the chained tails' grid instead (semantic/kernels/tune_tail_grid.py: programs per SM, warps,
# deeper pipelines, fp16 copies, the barriers' cost; int8, int4, fp8 and bf16 tails, <= 240 s), then one bench of
# fp8/int8/int4 on the packaged table and on the swept one (`--compare-tuning`: both sides in one process), then
# the fused tail's GPU tests (wider grids, fp16 copies: pytest-tail.log) and the 1-byte GPU tests, each stage
# within what is left. Files in $OUT: gpu.txt onebyte.json onebyte.rows.json bench.json summary.txt logs.tar.gz
# (tune.log bench.log pytest.log [pytest-tail.log]).
# Usage (repo root): [SWEEP=grid [GRID_ARGS=--balance-only] [PRECISIONS=bf16,fp8,int8,int4]] [BUDGET=190]
#   [FORMATS=fp8/channel,int8/g128,fp8/g128,int8/channel] bash scripts/onebyte_check.sh
. scripts/device_env.sh

left() { echo $((570 - SECONDS)); }
if [ "${SWEEP:-onebyte}" = grid ]; then
  # 1. the tails' sweep (its table written after each format), 2. one bench: every graph engine on the packaged
  # table and on the swept one (`@compare`), same weights, same process, 3. the GPU tests of what the sweep may pick
  timeout "${TUNE_TIMEOUT:-240}" python3 -m music3_demo.semantic.kernels.tune_tail_grid "$OUT/onebyte.json" \
    --formats "${FORMATS:-int8/g128,int4/g64,fp8/channel,bf16}" ${GRID_ARGS:-} 2>&1 | tee "$OUT/tune.log" \
    | cut -c1-220 | tail -n 60
  COMPARE=()
  [ -s "$OUT/onebyte.json" ] && COMPARE=(--compare-tuning "$OUT/onebyte.json")
  budget=$(( $(left) - 120 )); [ "$budget" -gt 90 ] || budget=90  # (the tests keep about two minutes)
  timeout "$budget" python3 -m music3_demo.bench semantic --model random-full --engine graph \
    --precision "${PRECISIONS:-fp8,int8,int4}" --prompt-tokens 400 --frames 300 "${COMPARE[@]}" \
    --output "$OUT/bench.json" 2>&1 \
    | grep -v 'should be kept in float32\|weight_norm' > "$OUT/bench.log"
  # the wider grids in one graph (1, 2 and 3 programs per SM), the fp16 copies against converting every tile, and
  # the balanced tails against their products one by one
  timeout "$(left)" python3 -m pytest -m gpu -q -p no:cacheprovider -k "mixed or fp16_copies or balanced" \
    "tests/semantic/test_kernels_gpu.py::test_fused_block_tail_equals_its_products_launched_one_by_one_across_graph_replays" \
    "tests/semantic/test_kernels_gpu.py::test_fp16_copies_of_a_quantized_tails_activations_change_no_bit" \
    "tests/semantic/test_kernels_gpu.py::test_balanced_tuned_tails_equal_their_products_one_by_one_and_the_unbalanced_tail" \
    2>&1 | tail -n 15 > "$OUT/pytest-tail.log"; tail -n 1 "$OUT/pytest-tail.log"
  TESTS=tests/semantic/test_quant_gpu.py
else
  timeout "${TUNE_TIMEOUT:-225}" python3 -m music3_demo.semantic.kernels.tune_onebyte "$OUT/onebyte.json" --budget "${BUDGET:-190}" \
    --formats "${FORMATS:-fp8/channel,int8/g128,fp8/g128,int8/channel}" 2>&1 | tee "$OUT/tune.log" \
    | grep -v '^SKIP\|^  tail' | tail -n 60
  TUNING=()
  [ -s "$OUT/onebyte.json" ] && TUNING=(--tuning "$OUT/onebyte.json")
  if [ "$(left)" -gt 60 ]; then
    timeout "$(left)" python3 -m music3_demo.bench semantic --model random-full --engine graph \
      --precision bf16,fp8,int8 --prompt-tokens 400 --frames 500 "${TUNING[@]}" \
      --output "$OUT/bench.json" 2>&1 | grep -v 'should be kept in float32\|weight_norm' > "$OUT/bench.log"
  fi
  TESTS=tests/semantic/test_quant_gpu.py
fi

# the GPU tests read this GPU's packaged table: the tuned one stands in for it here
[ -s "$OUT/onebyte.json" ] && cp "$OUT/onebyte.json" music3_demo/semantic/kernels/tuning/nvidia-h200.sm90.json
if [ "$(left)" -gt 30 ]; then
  timeout "$(left)" python3 -m pytest -m gpu $TESTS -q -p no:cacheprovider \
    2>&1 | grep -v 'should be kept in float32' > "$OUT/pytest.log"
else
  echo "no time for the GPU tests" > "$OUT/pytest.log"
fi
git checkout -- music3_demo/semantic/kernels/tuning/ 2>/dev/null

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = out / "onebyte.rows.json"
if rows.exists() and isinstance(json.loads(rows.read_text()), list):  # tune_tail_grid's rows
    for r in json.loads(rows.read_text()):
        what = r.get("us_per_block") or r.get("wrong") or r.get("skipped", "")[:80]
        print(f"grid {r['format']:12} {r['family']:6} per_sm {r['per_sm']} warps {r['num_warps']}"
              f" stages {'/'.join(map(str, r.get('stages', [])))} routes {'/'.join(map(str, r.get('routes', [])))}"
              f"{' fp16 copies' if r.get('halves') else ''}"
              f"{' (tuned)' if r['tuned'] else ''}: {what}"
              + (f" us/block; without barriers {r['without_barriers_us']}" if 'without_barriers_us' in r else ""))
elif rows.exists():
    doc = json.loads(rows.read_text())
    for r in doc["routes"]:
        print(f"route {r['format']:13} {r['route']:11} LM block (4 GEMVs) {r['lm_block_us']:8.1f} us")
    for r in doc["gemv"]:
        b = r["best"]
        print(f"gemv {r['format']:13} {str(r['shape']):28} {r['us']:7.1f} us {r['TBps']:5.2f} TB/s"
              f" (heuristic {r['heuristic_us']}, bf16 {r['bf16_us']} us {r['bf16_TBps']} TB/s)"
              f" bn{b['block_n']} bk{b['block_k']} w{b['num_warps']} s{b['num_stages']} sk{b['split_k']}"
              f" tma{int(b['tma'])} conv{b['convert']}")
    for r in doc["tails"]:
        print(f"tail {r['format']:13} {r['family']:6} {r['us_per_block']:7.1f} us/block {r['TBps']:5.2f} TB/s"
              f" conv {[r['best'][p]['convert'] for p in ('o', 'gate_up', 'down', 'qkv')]}")
else:
    print("no tuning rows (see tune.log)")
try:
    bench = json.loads((out / "bench.json").read_text())
    print("bench: frames/s at 400:", {k: round(v, 1) for k, v in bench["frames_per_s_by_engine"]["400"].items()},
          "tuning:", bench.get("tuning"), "compare:", bench.get("compare_tuning"))
    print("teacher-forced checks:", {k: v.get("ok") for k, v in bench.get("teacher_forced_check", {}).items()})
except Exception as error:  # noqa: BLE001
    print("bench failed:", error)
for name in ("pytest-tail.log", "pytest.log"):
    if (out / name).exists():
        log = (out / name).read_text().strip().splitlines()
        print(f"{name}:", log[-1] if log else "no output")
EOF
# at most 8 files come back from a device call: the logs travel as one archive
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
