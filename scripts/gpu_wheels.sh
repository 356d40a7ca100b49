#!/usr/bin/env bash
# The wheels a device call carries in .whl (~59 MiB; with the working tree it fits one call's 64 MiB): what the GPU
# image (Python 3.12, torch 2.11, triton 3.6, huggingface_hub 1.x, numpy, safetensors, nvidia-ml-py, pytest there)
# lacks for the project and the app: our pinned transformers, tokenizers and diffusers, gradio and gradio_client with
# the dependencies the image does not hold, soundfile with cffi. huggingface_hub stays the image's (1.x satisfies
# every pin here), so the CPU's 2.x is not carried. Versions are the ones requirements-dev.txt resolves to on the CPU.
# A call then starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
# (scripts/gpu_check.sh does both). Keep .whl ignored (.git/info/exclude) and name it in the call's carry.
# Usage (repo root): bash scripts/gpu_wheels.sh [FOLDER (.whl)]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
rm -rf "$dest"
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$dest" \
  transformers==5.24.0 tokenizers==0.23.3 diffusers==0.42.1 importlib_metadata==10.2.0 \
  gradio==6.31.0 gradio_client==2.7.2 hf-gradio==0.4.1 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
  opentelemetry-api==1.45.2 orjson==3.13.0 brotli==1.2.1 groovy==0.1.2 pydub==0.25.1 python-multipart==0.0.34 \
  pytz==2026.6 safehttpx==0.1.7 semantic-version==2.10.0 tomlkit==0.14.0 \
  soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
du -sh "$dest"
