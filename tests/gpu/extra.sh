#!/usr/bin/env bash
# The wheels the GPU kit (../shared/gpu) lacks, as one attachment for the GPU machine: .gpu/extra/x.tar.
#   bash tests/gpu/extra.sh          # here, from the project root (the package registries only)
# then on the GPU machine, after `source .gpu/stage/install.sh` and with `.gpu/extra/x.tar` carried:
#   mkdir -p /tmp/x && tar xf .gpu/extra/x.tar -C /tmp/x && python3 -m pip install -q --no-index --no-deps --target /tmp/gpu/site /tmp/x/*.whl
# - model-hosting-container-standards, jmespath, supervisor: `vllm serve` (vLLM 0.26's OpenAI server imports the
#   first; it needs the other two) — the smoke's distill row fails to start its server without them;
# - liger-kernel: the hf engine's `liger_kernel` option and gkd_gpu.py's trl-liger / full-liger sides;
# - torchvision 0.26.0 (+cu130 on PyPI, as the image's torch 2.11.0+cu130): vLLM 0.26 requires it, and its Qwen3.5 /
#   Qwen3-VL model module imports transformers' Qwen2-VL image processor, which imports torchvision in 5.17; without
#   it vLLM "failed to inspect" Qwen3_5ForConditionalGeneration.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 liger-kernel==0.8.5 torchvision==0.26.0)
rm -rf .gpu/extra/w && mkdir -p .gpu/extra/w
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu/extra/w "${WHEELS[@]}" 2>&1 \
    | grep -v '^WARNING: Location' || true
[ "$(ls .gpu/extra/w/*.whl | wc -l)" -eq "${#WHEELS[@]}" ] || { echo "extra.sh: not every wheel came: $(ls .gpu/extra/w)" >&2; exit 1; }
tar cf .gpu/extra/x.tar -C .gpu/extra/w .
echo "wrote .gpu/extra/x.tar ($(du -h .gpu/extra/x.tar | cut -f1)): $(ls .gpu/extra/w | tr '\n' ' ')"
