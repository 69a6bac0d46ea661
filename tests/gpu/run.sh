#!/usr/bin/env bash
# The GPU tests, on the GPU machine: one pytest process per module, and one per GRPO test (each of those
# starts a vLLM engine of its own, and one process holds one in-process vLLM).
#   source .gpu/stage/install.sh && bash tests/gpu/run.sh          # everything
#   bash tests/gpu/run.sh grpo                                       # the GRPO tests through the Python API
#   bash tests/gpu/run.sh cli [LAYOUT ...]                           # GRPO through `rlcore run` (2 GPUs): the layouts
#       colocate separate colocate_device_groups separate_device_groups, or those named
#   bash tests/gpu/run.sh gkd | sft | sampling | megatron             # one algorithm's or engine's tests, one process each
#   bash tests/gpu/run.sh sync                                       # weight sync: transports, replayed loads, GRPO's IPC paths,
#       the adapter-only sync (vllm_enable_lora)
#   (the smoke's distill row and liger-kernel need the wheels of tests/gpu/extra.sh installed too)
#   bash tests/gpu/run.sh verify 1, then verify 2                    # every GPU test and the smoke in two calls of at most
#       9 minutes, the session's GPU proof (tests/gpu/verify.py: logs and verify-N.json under $OUT)
#   bash tests/gpu/run.sh smoke [--cpu] [--out DIR] [ROW ...]         # every algorithm and engine from the CLI, one GPU,
#       one PASS/FAIL line a row in under 8 minutes (tests/gpu/smoke.py; --cpu: the rows that run without CUDA)
set -u
what=${1:-all}
if [ "$what" = smoke ]; then
    exec python3 "$(dirname "$0")/smoke.py" "${@:2}"
fi
if [ "$what" = verify ]; then
    exec python3 "$(dirname "$0")/verify.py" "${@:2}"
fi
case $what in
    all|grpo|cli|gkd|sft|sampling|megatron|sync) ;;
    *) echo "usage: bash tests/gpu/run.sh [verify 1|2 | all | grpo | cli [LAYOUT ...] | gkd | sft | sampling | megatron | sync | smoke [--cpu] ...]" >&2; exit 2 ;;
esac
layouts=${*:2}
status=0
# With $OUT set (the GPU machine's folder that comes back), each pytest run's output goes to $OUT/<its id>.log,
# the id's brackets and slashes turned into `_` (files with odd names do not come back), and one line is printed.
run() {
    if [ -z "${OUT:-}" ]; then python3 -m pytest -m gpu -q -p no:cacheprovider "$@" || status=1; return; fi
    local name start rc
    name=$(printf '%s' "$*" | sed 's#tests/gpu/##; s#[^A-Za-z0-9._-]#_#g' | cut -c1-150)
    start=$SECONDS
    python3 -m pytest -m gpu -q -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    printf '%-90s %s %4ss  %s\n' "$*" "$([ $rc -eq 0 ] && echo PASS || echo FAIL)" $((SECONDS - start)) \
        "$(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -1 | cut -c1-160)"
}
each() {  # every test of a module in a pytest process of its own
    while IFS= read -r id; do run "$id"; done < <(python3 -m pytest -m gpu -q --collect-only -p no:cacheprovider "$1" | grep '::')
}
if [ "$what" = all ]; then
    run tests/gpu/test_vllm_engine.py
    run tests/gpu/test_hf_cuda.py
    run tests/gpu/test_hf_packing_gpu.py
fi
if [ "$what" = all ] || [ "$what" = sync ]; then
    run tests/gpu/test_weight_sync_gpu.py
    run tests/gpu/test_weight_replay_gpu.py
fi
if [ "$what" = sync ]; then
    for test in test_colocated_on_ray test_vllm_worker_process test_rollout_tensor_parallel "test_separate_async and in_actor"; do
        run tests/gpu/test_grpo_gpu.py -k "$test"
    done
fi
if [ "$what" = all ] || [ "$what" = grpo ] || [ "$what" = sync ]; then
    each tests/gpu/test_vllm_lora_gpu.py
fi
if [ "$what" = all ] || [ "$what" = grpo ]; then
    each tests/gpu/test_grpo_gpu.py
fi
if [ "$what" = all ] || [ "$what" = cli ]; then
    for layout in ${layouts:-colocate separate colocate_device_groups separate_device_groups}; do
        run "tests/gpu/test_grpo_cli.py::test_grpo_from_the_cli[$layout]"
    done
fi
for module in gkd sft sampling megatron; do
    if [ "$what" = all ] || [ "$what" = "$module" ]; then
        each "tests/gpu/test_${module}_gpu.py"
        [ "$module" = megatron ] && each tests/gpu/test_megatron_cli.py
    fi
done
exit $status
