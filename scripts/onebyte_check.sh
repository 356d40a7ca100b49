#!/usr/bin/env bash
# One device call (<= 9.5 min): sweep the quantized GEMVs with their inputs handed over as the engine launches them
# (semantic/kernels/tune_onebyte.py: conversion routes x tiles x the per-group MMA twins), then per format one bench
# process (the packaged table against the swept one, `--compare-tuning`: same weights, same process; one format a
# process, as several quantized copies of the full model do not fit beside each other), then GPU tests with the swept
# table standing in for this GPU's packaged one (the device's copy of the checkout only): by default the tuning test
# (the device takes the table), as the benches' teacher-forced checks already run each format on it and the quantized
# tests' files (~6 min on a cold compile cache) do not fit beside the sweep; run them in a call of their own.
# Files in $OUT: gpu.txt tune.json tune.rows.json cmp-<format>.json summary.txt times.txt logs.tar.gz.
# Usage (repo root): MUSIC3_COMMIT=<sha> [LIMIT=570 (the call's seconds)] [BUDGET=230 (the sweep's)]
#   [FORMATS=int4/g64,fp8/channel,int8/g128] [FRAMES=300] [PRECISIONS=int4,fp8,int8]
#   [TESTS="tests/semantic/test_tuning_gpu.py"]
#   bash scripts/onebyte_check.sh
. scripts/device_env.sh >/dev/null

left() { echo $((${LIMIT:-570} - SECONDS)); }
t() { echo "$1 rc=$2 ${SECONDS} s" | tee -a "$OUT/times.txt"; }
budget=${BUDGET:-230}
timeout $((budget + 30)) python3 -m music3_demo.semantic.kernels.tune_onebyte "$OUT/tune.json" --budget "$budget" \
  --formats "${FORMATS:-int4/g64,fp8/channel,int8/g128}" > "$OUT/tune.log" 2>&1
t tune $?
for p in $(echo "${PRECISIONS:-int4,fp8,int8}" | tr , ' '); do
  [ -s "$OUT/tune.json" ] && [ "$(left)" -gt 90 ] || break
  timeout $(($(left) - 30)) python3 -m music3_demo.bench semantic --model random-full --engine graph --precision "$p" \
    --prompt-tokens 400 --frames "${FRAMES:-300}" --compare-tuning "$OUT/tune.json" --output "$OUT/cmp-$p.json" \
    > "$OUT/cmp-$p.log" 2>&1
  t "cmp-$p" $?
done

# the GPU tests read this GPU's packaged table: the swept one stands in for it here
if [ -s "$OUT/tune.json" ] && [ "$(left)" -gt 60 ] \
  && table=$(python3 -c "from music3_demo.semantic.kernels.tuning import Target; print(Target.of('cuda').slug)"); then
  cp "$OUT/tune.json" "music3_demo/semantic/kernels/tuning/$table"
  timeout $(($(left) - 10)) python3 -m pytest -m gpu ${TESTS:-tests/semantic/test_tuning_gpu.py} -q \
    -p no:cacheprovider --tb=short > "$OUT/pytest.log" 2>&1
  t pytest $?
  git checkout -- music3_demo/semantic/kernels/tuning/ 2>/dev/null
fi

python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = out / "tune.rows.json"
if rows.exists():
    doc = json.loads(rows.read_text())
    for r in doc["gemv"]:
        b = r["best"]
        print(f"gemv {r['format']:12} {str(r['shape']):26} {r['us']:7.1f} us (packaged {r['heuristic_us']})"
              f" bn{b['block_n']} bk{b['block_k']} w{b['num_warps']} s{b['num_stages']} sk{b['split_k']}"
              f" conv{b['convert']} dots{int(bool(b.get('group_dots')))}")
else:
    print("no sweep rows (see tune.log)")
for path in sorted(out.glob("cmp-*.json")):
    doc = json.loads(path.read_text())
    print(path.stem, {r["engine"]: round(r["frames_per_s"], 1) for r in doc["runs"]},
          "checks:", {k: v.get("ok") for k, v in doc.get("teacher_forced_check", {}).items()})
log = out / "pytest.log"
if log.exists():
    lines = log.read_text().strip().splitlines()
    print("pytest:", lines[-1] if lines else "no output")
PY
# at most 8 files come back from a device call: the logs travel as one archive
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
