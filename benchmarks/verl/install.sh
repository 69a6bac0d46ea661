#!/usr/bin/env bash
# On the GPU machine, sourced after the kit's install.sh: unpack verl's staged parts (/tmp/gpu/v*) into its own site
# directory /tmp/gpu/verl-site once, and export VERL_SITE for benchmarks/grpo_gpu.py, which puts it first on verl's
# Python path only (rlcore's and TRL's processes keep the image's transformers).
site=/tmp/gpu/verl-site
if [ ! -f /tmp/gpu/.verl-done ]; then
  ls /tmp/gpu/v* >/dev/null 2>&1 || { echo "install.sh: no verl parts in /tmp/gpu: stage them (benchmarks/verl/stage.sh)" >&2; return 2 2>/dev/null || exit 2; }
  rm -rf /tmp/gpu/vx && mkdir -p /tmp/gpu/vx "$site"
  cat /tmp/gpu/v[0-9]* | tar -C /tmp/gpu/vx -xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" /tmp/gpu/vx/wheels/*.whl
  rm -rf /tmp/gpu/vx /tmp/gpu/v[0-9]* && touch /tmp/gpu/.verl-done
fi
export VERL_SITE=$site
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 - <<'PY'
import importlib
for m in ("verl", "transformers", "tensordict", "hydra", "vllm", "ray"):
    try:
        mod = importlib.import_module(m); print(f"verl's {m:12s} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"verl's {m:12s} missing ({type(e).__name__}: {e})")
PY
