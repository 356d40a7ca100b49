#!/usr/bin/env bash
# One device call: carried wheels, [GEMV sweep,] GPU tests (`pytest -m gpu tests`), the semantic bench at 400 (both
# engines) and 4000 prompt tokens (graph), [the kernel profiles of a frame and of a flow chunk,] [the whole-song bench].
# Files in $OUT:
# gpu.txt [tune.log] [tail.log tuning.rows.json] [tuning.json] pytest.log bench_400.json bench_4000.json bench.log
# [profile_{semantic,flow}.{json,log}]
# [song.json song.log] [flow_batch.json flow_batch.log].
# Usage (repo root): MUSIC3_COMMIT=<sha> [TUNE=1] [TAIL=1] [TESTS=path | TESTS=none] [SEMANTIC=0]
#   [ENGINES=reference,graph] [ENGINES_4000=graph] [PROFILE=1 [PROFILE_MODES="semantic flow"]] [SONG=1] [BENCH_ARGS=...]
#   [FLOW_BATCH=1] (one flow chunk for 1, 2, 4 songs: merged DiT/vocoder calls vs one after another)
#   bash scripts/gpu_check.sh
# Put this checkout's sha in MUSIC3_COMMIT here, not `git rev-parse` run there: the device's copy of .git can be stale.
. scripts/device_env.sh
if [ "${TUNE:-0}" = 1 ]; then
  timeout "${TUNE_TIMEOUT:-420}" python3 -m music3_demo.semantic.kernels.tune_gemv "$OUT/tuning.json" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | grep -v '^SKIP'
fi
if [ "${TAIL:-0}" = 1 ]; then  # the chained block tail's sweep (kernels/tune_tail.py), after the GEMV's if both run
  timeout "${TAIL_TIMEOUT:-300}" python3 -m music3_demo.semantic.kernels.tune_tail "$OUT/tuning.json" 2>&1 | tee "$OUT/tail.log" | grep -v '^  '
fi
# a tuning run's table (kernels/tuning.py's format) is what the bench then launches with
if [ "${TESTS:-}" != none ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu ${TESTS:-tests} -q -s -p no:cacheprovider --durations=10 \
    2>&1 | grep -v 'should be kept in float32' | tee "$OUT/pytest.log" | tail -n 40
fi
[ "${SEMANTIC:-1}" = 0 ] || for spec in "400 ${ENGINES:-reference,graph}" "4000 ${ENGINES_4000:-graph}"; do
  set -- $spec
  timeout "${BENCH_TIMEOUT:-200}" python3 -m music3_demo.bench semantic --model random-full --engine "$2" \
    --prompt-tokens "$1" --frames 500 ${BENCH_ARGS:-} $([ -s "$OUT/tuning.json" ] && echo --tuning "$OUT/tuning.json") --output "$OUT/bench_$1.json" 2>&1 | grep -v 'should be kept in float32' >> "$OUT/bench.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], [(r['engine'], r['prompt_tokens'], round(r['frames_per_s'], 1), round(r['fraction_of_limit'], 3)) for r in d['runs']], d['graph_over_reference'])" "$OUT/bench_$1.json" || tail -n 20 "$OUT/bench.log"
done
if [ "${PROFILE:-0}" = 1 ]; then
  for mode in ${PROFILE_MODES:-semantic flow}; do
    timeout "${PROFILE_TIMEOUT:-150}" python3 -m music3_demo.bench profile $mode "$OUT/profile_$mode.json" 2>&1 \
      | grep -v 'should be kept in float32' | tee "$OUT/profile_$mode.log" | tail -n 12
  done
fi
if [ "${SONG:-0}" = 1 ]; then
  timeout "${SONG_TIMEOUT:-420}" python3 -m music3_demo.bench song --seconds 120 \
    --memory-song 300 --reference-song 8 --output "$OUT/song.json" 2>&1 | grep -v 'should be kept in float32' \
    > "$OUT/song.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d)[:3000])" "$OUT/song.json" \
    || tail -n 20 "$OUT/song.log"
fi
if [ "${FLOW_BATCH:-0}" = 1 ]; then
  timeout "${FLOW_BATCH_TIMEOUT:-300}" python3 -m music3_demo.bench flow-batch --output "$OUT/flow_batch.json" 2>&1 \
    | grep -v 'should be kept in float32' > "$OUT/flow_batch.log"
  tail -n 6 "$OUT/flow_batch.log" | cut -c1-3000
fi
