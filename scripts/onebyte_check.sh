#!/usr/bin/env bash
# One device call (<= 9.5 min on an H200): sweep the quantized GEMVs (semantic/kernels/tune_onebyte.py: conversion
# routes x tiles, <= 225 s), bench bf16/fp8/int8 with the table it wrote, then the 1-byte GPU tests with that table as
# this GPU's packaged one (the device's copy of the checkout only). Files in $OUT: gpu.txt onebyte.json
# onebyte.rows.json bench.json summary.txt logs.tar.gz (tune.log bench.log pytest.log).
# Usage (repo root): [BUDGET=190] [FORMATS=fp8/channel,int8/g128,fp8/g128,int8/channel] bash scripts/onebyte_check.sh
. scripts/device_env.sh

left() { echo $((570 - SECONDS)); }
timeout "${TUNE_TIMEOUT:-225}" python3 -m music3_demo.semantic.kernels.tune_onebyte "$OUT/onebyte.json" \
  --budget "${BUDGET:-190}" --formats "${FORMATS:-fp8/channel,int8/g128,fp8/g128,int8/channel}" 2>&1 \
  | tee "$OUT/tune.log" | grep -v '^SKIP' | tail -n 60
TUNING=()
[ -s "$OUT/onebyte.json" ] && TUNING=(--tuning "$OUT/onebyte.json")
if [ "$(left)" -gt 60 ]; then
  timeout "$(left)" python3 -m music3_demo.bench semantic --model random-full --engine graph \
    --precision bf16,fp8,int8 --prompt-tokens 400 --frames 500 "${TUNING[@]}" \
    --output "$OUT/bench.json" 2>&1 | grep -v 'should be kept in float32\|weight_norm' > "$OUT/bench.log"
fi
TESTS=tests/semantic/test_quant_gpu.py

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
if rows.exists():
    doc = json.loads(rows.read_text())
    for r in doc["routes"]:
        print(f"route {r['format']:13} {r['route']:11} LM block (4 GEMVs) {r['lm_block_us']:8.1f} us")
    for r in doc["gemv"]:
        b = r["best"]
        print(f"gemv {r['format']:13} {str(r['shape']):28} {r['us']:7.1f} us {r['TBps']:5.2f} TB/s"
              f" (heuristic {r['heuristic_us']}, bf16 {r['bf16_us']} us {r['bf16_TBps']} TB/s)"
              f" bn{b['block_n']} bk{b['block_k']} w{b['num_warps']} s{b['num_stages']} sk{b['split_k']}"
              f" tma{int(b['tma'])} conv{b['convert']}")
else:
    print("no tuning rows (see tune.log)")
try:
    bench = json.loads((out / "bench.json").read_text())
    print("bench: frames/s at 400:", {k: round(v, 1) for k, v in bench["frames_per_s_by_engine"]["400"].items()},
          "tuning:", bench.get("tuning"), "compare:", bench.get("compare_tuning"))
    print("teacher-forced checks:", {k: v.get("ok") for k, v in bench.get("teacher_forced_check", {}).items()})
except Exception as error:  # noqa: BLE001
    print("bench failed:", error)
if (out / "pytest.log").exists():
    log = (out / "pytest.log").read_text().strip().splitlines()
    print("pytest.log:", log[-1] if log else "no output")
EOF
# at most 8 files come back from a device call: the logs travel as one archive
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
