#!/usr/bin/env bash
# The two-GPU runs on nvidia-h200-x2, one device call per part (each <= 9.5 min), on one warm machine:
#   PART=1 (carry .whl): the two-GPU GPU tests (tests/ui/test_two_gpus_gpu.py), then the stage split against one GPU
#          (`bench split`: keep the split only at a 25% cut of a 120-s song's wall time, the same song);
#   PART=2 (carry .whl): eight users on two GPUs through the app's API (`bench users --devices cuda:0,cuda:1
#          --phases alone,eight`, 60-s songs: all eight within 2.2x one user alone, each first audio <= 3 s);
#   PART=3 (carry .whl-ray, from scripts/ray_gpu_wheels.sh; the wheels of part 1 or 2 still in /tmp/site): the Ray
#          backend with two replicas (`bench ray --replicas 2 --slots 2 --users 4 --kill`: four songs over both
#          GPUs, each its seed's in-process song, a replica killed mid-song, the front still serving).
# Files in $OUT: gpu.txt and, by part, pytest.log stage_split.json split.log | users.json users.log users_app.log |
# ray.json ray.log.
# Usage (repo root): MUSIC3_COMMIT=<sha> PART=1|2|3 bash scripts/two_gpus_check.sh
. scripts/device_env.sh
left() { echo $((570 - SECONDS)); }
quiet() { grep -v 'should be kept in float32\|weight_norm'; }

case "${PART:-1}" in
  1)
    timeout 300 python3 -m pytest -m gpu tests/ui/test_two_gpus_gpu.py -q -s -p no:cacheprovider 2>&1 | quiet \
      > "$OUT/pytest.log"; tail -n 3 "$OUT/pytest.log"
    timeout "$(left)" python3 -m music3_demo.bench split --seconds 120 2>&1 | quiet > "$OUT/split.log"
    tail -n 25 "$OUT/split.log"
    ;;
  2)
    timeout "$(left)" python3 -m music3_demo.bench users --devices cuda:0,cuda:1 --phases alone,eight --seconds 60 \
      2>&1 | quiet > "$OUT/users.log"; tail -n 40 "$OUT/users.log"
    ;;
  3)
    python3 -c "import ray; print('ray', ray.__version__)" || exit 1
    timeout "$(left)" python3 -m music3_demo.bench ray --replicas 2 --slots 2 --users 4 --kill --runs 1 \
      --seconds 60 --output "$OUT/ray.json" 2>&1 | quiet > "$OUT/ray.log"; tail -n 40 "$OUT/ray.log"
    ;;
  *) echo "PART must be 1, 2 or 3" >&2; exit 2 ;;
esac
