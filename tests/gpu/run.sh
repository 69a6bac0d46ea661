#!/usr/bin/env bash
# The GPU tests, on the GPU machine: one pytest process per module, and one per GRPO test (each of those
# starts a vLLM engine of its own, and one process holds one in-process vLLM).
#   source .gpu/stage/install.sh && bash tests/gpu/run.sh          # everything (about 8 minutes on 2 H200s)
#   bash tests/gpu/run.sh grpo                                       # the GRPO tests only
set -u
status=0
run() { python3 -m pytest -m gpu -q -p no:cacheprovider "$@" || status=1; }
if [ "${1:-all}" = all ]; then
    run tests/gpu/test_vllm_engine.py
    run tests/gpu/test_weight_sync_gpu.py
    run tests/gpu/test_hf_cuda.py
fi
for test in test_colocated_vllm test_colocated_on_ray test_rollout_tensor_parallel "test_separate_async and in_actor" "test_separate_async and core_processes"; do
    run tests/gpu/test_grpo_gpu.py -k "$test"
done
exit $status
