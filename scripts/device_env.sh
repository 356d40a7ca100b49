# Sourced by the device-call harnesses (gpu_check.sh, onebyte_check.sh, two_gpus_check.sh) from the repository
# root: makes $OUT, installs the carried wheels (.whl into /tmp/site; .whl-ray into /tmp/ray-site, compiled: without
# .pyc files every Ray process compiles Ray again at start), sets PYTHONPATH (absolute: Ray's processes inherit it)
# and writes the GPUs and library versions to $OUT/gpu.txt.
set -o pipefail
OUT=${OUT:-/tmp/music3_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
if ls .whl-ray/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/ray-site .whl-ray/*.whl || exit 1
fi
export PYTHONPATH=/tmp/ray-site:/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
python3 - <<'PY' | tee -a "$OUT/gpu.txt"
from importlib.metadata import PackageNotFoundError, version

found = []
for name in ("torch", "triton", "transformers", "diffusers", "gradio", "ray"):
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print(", ".join(found))
PY
