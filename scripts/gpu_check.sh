#!/usr/bin/env bash
# One device run: GPU tests and benchmarks for the named stages, logs under $OUT (or ./gpu-out).
# Usage: bash scripts/gpu_check.sh activation layouts gemm experts layer ep hf-e2e
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT/bench"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (transformers >= 5.24 for the HF tests)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
summary="$OUT/summary.txt"
: > "$summary"
step() {  # step NAME CMD...: run, log, record status and seconds
    local name="$1"; shift
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$summary"
    tail -n 25 "$OUT/$name.log"
}
native_checks() {  # native_checks PROBE_S TESTS_S SANITIZER_S [PYTEST_FLAG...]: the native grouped GEMM's exact-integer
    # probes, then, only if they passed (a hang or a wrong mapping stops there), its GPU tests against float64 and
    # memcheck; returns 1 when the probes failed, so a stage runs its timings only after them
    local probe_s=$1 tests_s=$2 sanitizer_s=$3; shift 3
    STEP_TIMEOUT=$probe_s step probe-native-gemm python3 scripts/native_gemm_probe.py
    grep -q "probe-native-gemm rc=0" "$summary" || return 1
    STEP_TIMEOUT=$tests_s step test-native-grouped python3 -m pytest -q "$@" tests/test_native.py \
        tests/test_cuda_backend.py tests/test_native_grouped_gpu.py
    STEP_TIMEOUT=$sanitizer_s step sanitizer-native-grouped compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m pytest -q -m gpu tests/test_native_grouped_gpu.py -k sanitizer
}
ncu_native() {  # ncu_native PRESET:TOKENS:STAGE...: Nsight Compute of that GEMM, Triton and native (ncu_small.py native)
    local ncu_sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
                        --section WarpStateStats --section SchedulerStats
                        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
    local case preset tokens stage
    for case in "$@"; do
        IFS=: read -r preset tokens stage <<< "$case"
        STEP_TIMEOUT=150 step "ncu-native-$preset-$stage" ncu "${ncu_sections[@]}" \
            -k "regex:_expert_gemm|grouped_gemm" python3 scripts/ncu_small.py native "$preset" "$tokens" "$stage"
    done
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv,noheader | tee -a "$summary"
# REQUIRE_GPU=H200: stop at once (exit 3) on any other card, for timings that must come from that card
# (a machine asked for as nvidia-h200 may be an H100)
if [ -n "${REQUIRE_GPU:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$REQUIRE_GPU"; then
    echo "not an $REQUIRE_GPU: stopped (REQUIRE_GPU)" | tee -a "$summary"
    exit 3
fi
# A carried .peers must be the adapted copy (scripts/setup_peers.sh: our MXFP4 weights prepared at build, as
# triton_kernels' are swizzled at build); a plain copy of the harness times the unprepared kernel
if [ -f .peers/bench_peers.py ] && ! grep -q "_scales).prepare_for()" .peers/bench_peers.py; then
    echo ".peers is not set up by scripts/setup_peers.sh (MXFP4 weights unprepared): stopped" | tee -a "$summary"
    exit 4
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$summary"
# MONITOR=1: the card's power draw, SM clock and temperature every 200 ms into $OUT/monitor.csv, for
# timings that may come from a power-capped (down-clocked) card
if [ "${MONITOR:-0}" = 1 ]; then
    nvidia-smi --query-gpu=timestamp,power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 200 > "$OUT/monitor.csv" 2>&1 &
    monitor_pid=$!
    trap 'kill $monitor_pid 2>/dev/null' EXIT
fi
for stage in "$@"; do
    case "$stage" in
        activation)
            step test-activation python3 -m pytest -q -m gpu tests/test_activation_gpu.py
            step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench" ;;
        layouts)
            step test-layouts python3 -m pytest -q -m gpu tests/test_layouts_gpu.py
            step sanitizer-layouts compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_layouts_gpu.py -k sanitizer
            step bench-permute python3 benchmarks/bench_permute.py --out "$OUT/bench" ;;
        gemm)
            step test-gemm python3 -m pytest -q -m gpu tests/test_gemm_gpu.py
            step bench-gemm python3 benchmarks/bench_gemm.py --out "$OUT/bench" ;;
        gemm-tests)
            step test-gemm python3 -m pytest -q -m gpu tests/test_gemm_gpu.py ;;
        routing)
            step test-routing python3 -m pytest -q -m gpu tests/test_routing_gpu.py ;;
        experts)
            step test-experts python3 -m pytest -q -m gpu tests/test_experts_gpu.py ;;
        compile-op)  # a FusedMoE forward as one op under torch.compile (padded_moe::moe_forward): compiled equals
            # eager bit for bit in every mode, the suites around it, no syncs; compiled host time at 1 token
            step test-compile-op python3 -m pytest -q -m gpu tests/test_compile_gpu.py tests/test_launch_plan_gpu.py \
                -k "not matches_eager"
            step profile-compiled python3 benchmarks/profile_host.py --cases --layers gpt-oss-120b:1 qwen3-30b-a3b:1 \
                dsv4-flash:1 --calls 30 ;;
        hf-gpt-oss)  # HF parity on GPT-OSS's re-laid bf16 weights and the GPT-OSS-like HF bench (its grouped_mm
            # baseline reads the re-laid arrangement); with compile-op, the owed one-GPU runs of session 39
            step test-hf-gpt-oss python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py -k "gpt_oss"
            step bench-hf-gpt-oss python3 benchmarks/bench_hf.py --models gpt_oss --iters 5 --out "$OUT/bench" ;;
        native-gemm)  # the native grouped GEMM (backend "cuda"): exact-integer probes first (a hang or a wrong
            # mapping stops the stage there), GPU tests vs float64, memcheck; `native-bench` times it
            native_checks 150 300 300 ;;
        native-bench)  # the native grouped GEMM vs the Triton GEMM: GEMMs alone and whole calls, five model cases
            STEP_TIMEOUT=560 step bench-native-gemm python3 benchmarks/bench_native_gemm.py --out "$OUT/bench" ;;
        native-bench-bf16)  # the same on the three bf16 presets (every configuration incl. the 256-row tiles)
            STEP_TIMEOUT=560 step bench-native-gemm python3 benchmarks/bench_native_gemm.py --out "$OUT/bench" \
                --presets dsv4-flash,qwen3-30b-a3b,mixtral-8x7b ;;
        dyn-walk)  # wide-tiles on the bf16 presets, then Nsight Compute of Mixtral's GEMM2 (Triton, the native
            # configurations and walks): ncu sat on the native kernel's first replay pass in run 240
            wide_presets=dsv4-flash,mixtral-8x7b,qwen3-30b-a3b; ncu_after=mixtral-8x7b:8192:w2 ;&
        wide-tiles)  # the native GEMM's tile shapes and walks in one short run: probes (both walks), GPU tests,
            # memcheck, the GEMMs and whole calls at 8192 tokens (WIDE_TOKENS; MXFP4 beside unless dyn-walk)
            if native_checks 150 150 80 -x; then
                STEP_TIMEOUT=200 step bench-native-gemm python3 benchmarks/bench_native_gemm.py --out "$OUT/bench" \
                    --presets "${wide_presets:-dsv4-flash,gpt-oss-120b:mxfp4,mixtral-8x7b,qwen3-30b-a3b}" \
                    --tokens "${WIDE_TOKENS:-8192}" --rounds 2
                if [ -n "${ncu_after:-}" ]; then ncu_native "$ncu_after"; fi
            fi ;;
        wide-min)  # wide-tiles' correctness part in under three minutes: probes, then the GPU tests of every
            # configuration and of MXFP4 weights
            STEP_TIMEOUT=90 step probe-native-gemm python3 scripts/native_gemm_probe.py
            STEP_TIMEOUT=80 step test-native-grouped python3 -m pytest -q -x tests/test_native_grouped_gpu.py \
                -k "every_config or mxfp4 or tiny" ;;
        decode-native)  # the decode GEMM2 through NativeLibrary (the MXFP4 decode tests), the docs' examples
            # (incl. backend "cuda")
            step test-decode-native python3 -m pytest -q -m gpu tests/test_decode_gpu.py -k "native or mxfp4"
            STEP_TIMEOUT=150 step test-docs python3 -m pytest -q tests/test_docs_examples.py ;;
        auto-peers)  # the library's defaults as a user gets them: the GPU tests of the backends' choice, then the
            # peers harness (.peers carried; no layout or backend forced; each case gets an equal share of the
            # time budget and a later case what an earlier one left, so DeepSeek-V4 bf16, the longest, goes last)
            STEP_TIMEOUT=150 step test-auto python3 -m pytest -q tests/test_cuda_backend.py tests/test_native.py
            # the native libraries built before the harness (its first GPT-OSS 8192-token call would build them
            # inside that case's share of the budget)
            STEP_TIMEOUT=120 step build-native python3 -m padded_moe build-native
            STEP_TIMEOUT=460 step peers-auto env BUDGET_S=380 TIMEOUT_S=450 bash .peers/run.sh \
                --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx,qwen3,mixtral,dsv4 ;;
        rs-peers)  # the RS kernel as auto takes it (GPT-OSS prefill): GPU tests of auto and the RS path, GPT-OSS
            # whole calls at 6144 / 8192 tokens with each variant's kernels (torch.profiler), then the peers
            # harness's MXFP4 cases (.peers carried)
            STEP_TIMEOUT=200 step test-rs-auto python3 -m pytest -q tests/test_cuda_backend.py tests/test_native.py \
                tests/test_native_grouped_gpu.py -k "auto or rs"
            STEP_TIMEOUT=200 step rs-calls python3 benchmarks/bench_native_gemm.py --calls-only --rounds 7 --breakdown \
                --presets gpt-oss-120b:mxfp4 --tokens 6144,8192 --out "$OUT/bench/rs-calls" \
                --variants "auto;grouped, Triton;grouped, cuda;grouped, cuda, fused"
            STEP_TIMEOUT=260 step peers-mx env BUDGET_S=200 TIMEOUT_S=250 bash .peers/run.sh \
                --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx ;;
        rs-final)  # the RS kernel's pieces and counter walk as defaults: its GPU tests, memcheck, the peers' MXFP4
            # cases, then whole calls at the RS rows of both MXFP4 presets (pieces / whole boxes, static / counter)
            STEP_TIMEOUT=200 step test-rs python3 -m pytest -q -x tests/test_native_grouped_gpu.py \
                -k "rs or auto or sanitizer_small"
            grep -q "test-rs rc=0" "$summary" || exit 1
            STEP_TIMEOUT=90 step sanitizer-rs compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_native_grouped_gpu.py -k "rs_sanitizer"
            STEP_TIMEOUT=200 step peers-mx env BUDGET_S=150 TIMEOUT_S=190 bash .peers/run.sh \
                --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx
            STEP_TIMEOUT=120 step rs-final-calls python3 benchmarks/bench_native_gemm.py --calls-only --rounds 5 \
                --presets gpt-oss-120b:mxfp4,dsv4-flash:mxfp4 --tokens 6144,8192 --out "$OUT/bench/rs-final" \
                --variants "auto;grouped, cuda;grouped, cuda, whole boxes;grouped, cuda, whole boxes, dynamic;grouped, \
cuda, fused;grouped, cuda, fused, whole boxes, dynamic" ;;
        gather)  # GEMM1 gathering its rows (RS and bf16 kernels): the gather GPU tests (bit-equal to the permuted
            # copy's in every mode and configuration; GATHER_TESTS: another -k), memcheck, whole calls at 8192 tokens
            # of the MXFP4 presets with and without the gather (each variant's kernels), the peers' GPT-OSS case at
            # 128 and 8192 tokens (.peers carried), then DeepSeek-V4 bf16 whole calls with and without
            STEP_TIMEOUT=240 step test-gather python3 -m pytest -q -x tests/test_native_grouped_gpu.py \
                -k "${GATHER_TESTS:-rs or auto or sanitizer_small or gather or every_config}"
            grep -q "test-gather rc=0" "$summary" || exit 1
            STEP_TIMEOUT=150 step sanitizer-gather compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_native_grouped_gpu.py -k "sanitizer"
            STEP_TIMEOUT=200 step gather-calls-mx python3 benchmarks/bench_native_gemm.py --calls-only --rounds 5 \
                --breakdown --presets gpt-oss-120b:mxfp4,dsv4-flash:mxfp4 --tokens 8192 --out "$OUT/bench/gather-mx" \
                --variants "auto;grouped, cuda, dynamic;grouped, cuda, dynamic, gather;grouped, cuda, fused, dynamic;\
grouped, cuda, fused, dynamic, gather"
            # the peers' GPT-OSS case at the token counts where #12's target is not met yet (.peers carried)
            if [ -d .peers ]; then
                STEP_TIMEOUT=150 step peers-gather env BUDGET_S=110 TIMEOUT_S=140 bash .peers/run.sh \
                    --tokens 128,8192 --cases gptoss
            fi
            STEP_TIMEOUT=150 step gather-calls-bf16 python3 benchmarks/bench_native_gemm.py --calls-only --rounds 5 \
                --breakdown --presets dsv4-flash --tokens 8192 --out "$OUT/bench/gather-bf16" \
                --variants "auto;grouped, cuda;grouped, cuda, gather" ;;
        peers-dsv4-8192)  # the peers harness's DeepSeek-V4 bf16 case at 8192 tokens alone (.peers carried), the
            # native library built first (auto runs it there)
            STEP_TIMEOUT=120 step build-native python3 -m padded_moe build-native
            STEP_TIMEOUT=210 step peers-dsv4-8192 env OUT="$OUT/peers-dsv4-8192" BUDGET_S=160 TIMEOUT_S=200 \
                bash .peers/run.sh --tokens 8192 --cases dsv4 ;;
        load-policies)  # which TMA loads carry L2 policy operands (grouped.LOAD_POLICIES): probes, the native
            # GEMM's GPU tests (every configuration), memcheck, then the equal-rows probe with the masks varied
            if native_checks 90 150 80 -x; then
                STEP_TIMEOUT=200 step dense-probe-policies python3 scripts/native_dense_probe.py \
                    --cases dense,dsv4,qwen3,mixtral --variants "triton,c0,c0 p2,c0 p1,c0 p0,c3 dyn,c3 dyn p3"
            fi ;;
        dense-probe)  # equal rows per expert: cuBLAS bmm / Triton / the native configurations and walks, dense
            # (one expert) and the presets' GEMM1 shapes at 8192 tokens
            STEP_TIMEOUT=240 step dense-probe python3 scripts/native_dense_probe.py ;;
        dense-ncu)  # Nsight Compute of the equal-rows Mixtral GEMM1 (DENSE_CASE): Triton (at cuBLAS's rate there)
            # against the native kernel, the sections that finish on the native kernel under kernel replay
            STEP_TIMEOUT=150 step "ncu-dense-${DENSE_CASE:-mixtral}" ncu --section SpeedOfLight \
                --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
                --metrics dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,smsp__warps_issue_stalled_gmma.sum,smsp__inst_executed.sum \
                -k regex:"grouped_gemm|_expert_gemm" python3 scripts/native_dense_probe.py --once \
                --cases "${DENSE_CASE:-mixtral}" --variants "triton,c0 dyn" ;;
        l2-ncu)  # where the operand feed goes (equal rows, dense and Mixtral GEMM1): for cuBLAS, Triton and the
            # native kernel, the bytes landed in shared memory, the L2 sectors read for them, the traffic between
            # the two L2 partitions, the L2's throughput and the clocks (a metrics list: one pass per kernel)
            l2_metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,l1tex__m_xbar2l1tex_read_bytes.sum
            l2_metrics+=,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum
            l2_metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__cluster_dim_x
            STEP_TIMEOUT=200 step ncu-l2 ncu --metrics "$l2_metrics" -k regex:"grouped_gemm|_expert_gemm|nvjet|xmma|cutlass" \
                python3 scripts/native_dense_probe.py --once \
                --cases dense,mixtral --variants "triton,c0,c3 dyn" ;;
        auto-band)  # whole calls at rows per expert around AUTO_NATIVE_ROWS (128-320) on the three bf16 presets
            band_variants="auto;grouped, Triton;grouped, cuda c0;grouped, cuda c3 dyn"
            for case in ${BAND_CASES:-dsv4-flash:5461,6827,10923,13653 qwen3-30b-a3b:2048,3072,4096 mixtral-8x7b:512,768,1024}; do
                STEP_TIMEOUT=${BAND_STEP_S:-60} step "band-${case%%:*}" python3 benchmarks/bench_native_gemm.py \
                    --out "$OUT/bench-band-${case%%:*}" --presets "${case%%:*}" --tokens "${case#*:}" --rounds 2 \
                    --calls-only --variants "$band_variants"
            done ;;
        native-peers)  # the peers harness (.peers carried) with ours on the native kernel: GROUPED_CONTIGUOUS +
            # backend cuda through the environment, all five cases (the decode path is off for it)
            STEP_TIMEOUT=560 step peers-native env PADDED_MOE_GEMM_LAYOUT=grouped_contiguous PADDED_MOE_GEMM_BACKEND=cuda \
                BUDGET_S=440 TIMEOUT_S=540 bash .peers/run.sh --tokens 1,16,128,1024,8192 \
                --cases gptoss,dsv4mx,dsv4,qwen3,mixtral ;;
        layer-plan)  # decode-sized FusedMoE forwards as one launch plan (gate kernel + router + experts): GPU
            # tests of the plan and the gate kernel, the suites that call the layer, memcheck, host time per layer
            step test-layer-plan python3 -m pytest -q -m gpu tests/test_launch_plan_gpu.py tests/test_routing_gpu.py
            step test-layer-suites python3 -m pytest -q -m gpu tests/test_experts_gpu.py tests/test_compile_gpu.py \
                -k "layer or once or preset or compile or sync"
            step test-hf-parity python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py
            step sanitizer-layer-plan compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_launch_plan_gpu.py tests/test_routing_gpu.py -k "layer_forward and (mixtral or gpt) or gate_kernel"
            step profile-host python3 benchmarks/profile_host.py --cases gptoss:1 --layers gpt-oss-120b:1 \
                qwen3-30b-a3b:1 dsv4-flash:1 qwen3-30b-a3b:8 mixtral-8x7b:1 --calls 50 ;;
        layer)
            step bench-layer python3 benchmarks/bench_layer.py --out "$OUT/bench" ;;
        profile)
            step profile-layer python3 benchmarks/profile_layer.py --tokens 16 1024 8192 ;;
        decode-profile)  # decode-sized forwards as graph replays: replay time vs the sum of kernel times, per kernel
            for pw in qwen3-30b-a3b:bf16 gpt-oss-120b:bf16 dsv4-flash:bf16 mixtral-8x7b:bf16 gpt-oss-120b:mxfp4; do
                step "profile-${pw%%:*}-${pw##*:}" python3 benchmarks/profile_layer.py --graph --preset "${pw%%:*}" \
                    --weights "${pw##*:}" --tokens 1 8 32
            done ;;
        decode-check)  # one-program layouts on the GPU (tests, sanitizer, replays), prepared-MXFP4 table, decode profile
            step test-layouts python3 -m pytest -q -m gpu tests/test_layouts_gpu.py
            step sanitizer-layouts compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_layouts_gpu.py -k "sanitizer or (cuda_matches and 3-6-256)"
            step test-plans python3 -m pytest -q -x -m gpu tests/test_launch_plan_gpu.py
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k hopper
            step profile-qwen3 python3 benchmarks/profile_layer.py --graph --preset qwen3-30b-a3b --tokens 1 8
            STEP_TIMEOUT=200 step bench-mx-hopper python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss \
                --rows 1,32,2048 --out "$OUT/bench-mx-hopper" ;;
        mx-table)  # prepared-MXFP4 kernel and table: GPU exactness (folded and byte scales), sanitizer, the GPT-OSS sweep
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k hopper
            step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            STEP_TIMEOUT=200 step bench-mx-hopper python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss \
                --rows 1,32,128,512,2048 --out "$OUT/bench-mx-hopper" ;;
        mx-pairs)  # the 4-plane prepared MXFP4 kernel (one dot per K step): GPU exactness, sanitizer, 2 vs 4 planes, peers, sweep
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k hopper
            step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            STEP_TIMEOUT=150 step bench-mx-planes python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss,dsv4-flash \
                --rows 1,32,128,512,2048 --no-sweep --out "$OUT/bench-mx-planes"
            if [ -d .peers ]; then
                STEP_TIMEOUT=170 step peers env PM_PLANES=4 OUT="$OUT/peers" BUDGET_S=120 TIMEOUT_S=160 bash .peers/run.sh \
                    --tokens 16,128,1024,8192 --cases gptoss,dsv4mx
            fi
            STEP_TIMEOUT=${SWEEP_S:-200} step sweep-mx4 python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss \
                --rows 1,32,128,512,2048 --sweep-planes 4 --out "$OUT/sweep-mx4" ;;
        mx-pairs-final)  # 4 planes the default with its tuned table: prepared-MXFP4 tests, sanitizer, the suites that prepare
            # weights (experts, plans, HF parity), the owed decode checks, peers at every T, the compiled MXFP4 layer
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "hopper and not big_tiles"
            step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py tests/test_decode_gpu.py -k "hopper_small_sanitizer or sanitizer"
            step test-experts python3 -m pytest -q -m gpu tests/test_experts_gpu.py tests/test_launch_plan_gpu.py tests/test_decode_gpu.py
            step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py
            if [ -d .peers ]; then
                STEP_TIMEOUT=200 step peers env OUT="$OUT/peers" BUDGET_S=150 TIMEOUT_S=190 bash .peers/run.sh \
                    --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx
            fi
            step test-compile-mx python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k "mxfp4" ;;
        mx-pairs-peers)  # the final 4-plane table: peers at every T, the compiled MXFP4 layer, the sweep timed on INDEXED
            if [ -d .peers ]; then
                STEP_TIMEOUT=170 step peers env OUT="$OUT/peers" BUDGET_S=130 TIMEOUT_S=165 bash .peers/run.sh \
                    --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx
            fi
            STEP_TIMEOUT=150 step test-compile-mx python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k "mxfp4"
            STEP_TIMEOUT=${SWEEP_S:-150} step sweep-mx4 python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss \
                --rows 1,32,128,512,2048 --sweep-planes 4 --out "$OUT/sweep-mx4" ;;
        mx-wsh)  # the mx_w_shared sweep candidates (upcast tile as the shared-memory operand): GPU exactness on every
            # candidate and both arrangements, sanitizer, the INDEXED-timed sweep on both models, peers at every T
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "hopper"
            step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            step test-decode-compiled python3 -m pytest -q -m gpu tests/test_decode_gpu.py -k compiled
            STEP_TIMEOUT=${SWEEP_S:-200} step sweep-mx4 python3 benchmarks/bench_gemm.py --mxfp4-hopper \
                --models gpt-oss,dsv4-flash --rows 128,512,2048 --sweep-planes 4 --out "$OUT/sweep-mx4"
            if [ -d .peers ]; then
                STEP_TIMEOUT=170 step peers env OUT="$OUT/peers" BUDGET_S=130 TIMEOUT_S=165 bash .peers/run.sh \
                    --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx
            fi ;;
        blocks)  # INDEXED row blocks with a margin over the mean and 128-row blocks: the GEMM and pipeline tests, peers on every model
            step test-gemm python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "real_shapes or forced or graph"
            step test-experts python3 -m pytest -q -m gpu tests/test_experts_gpu.py tests/test_launch_plan_gpu.py \
                tests/test_layouts_gpu.py
            if [ -d .peers ]; then
                STEP_TIMEOUT=320 step peers env OUT="$OUT/peers" BUDGET_S=270 TIMEOUT_S=310 bash .peers/run.sh \
                    --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx,dsv4,qwen3,mixtral --check-tokens 64,1024
            fi ;;
        mx-resweep)  # prepared MXFP4 tiles: where the GPT-OSS layer spends its time, then the sweep timed on INDEXED on
            # both models (rows per expert from GPTOSS_ROWS / DSV4_ROWS; runs 90-92 split them over three calls)
            step profile-gptoss python3 benchmarks/profile_layer.py --preset gpt-oss-120b --weights mxfp4 \
                --tokens 128 1024 8192 --graph
            STEP_TIMEOUT=${SWEEP_S:-300} step sweep-mx4-gptoss python3 benchmarks/bench_gemm.py --mxfp4-hopper \
                --models gpt-oss --rows "${GPTOSS_ROWS:-4,16,64,256,1024}" --sweep-planes 4 --out "$OUT/sweep-mx4"
            STEP_TIMEOUT=${SWEEP_S:-300} step sweep-mx4-dsv4 python3 benchmarks/bench_gemm.py --mxfp4-hopper \
                --models dsv4-flash --rows "${DSV4_ROWS:-8,64,192,1024}" --sweep-planes 4 --out "$OUT/sweep-mx4" ;;
        mx-retable)  # the re-swept prepared-MXFP4 table: GPU exactness of every candidate and of the table, sanitizer
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "hopper"
            step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            step test-plans python3 -m pytest -q -m gpu tests/test_launch_plan_gpu.py tests/test_decode_gpu.py ;;
        fusion)  # the activation in GEMM1's epilogue: GPU exactness vs two steps, sanitizer, the suites that call
            # fused_experts, whole-call timing with and without it
            STEP_TIMEOUT=300 step test-epilogue python3 -m pytest -q -n 4 -m gpu tests/test_gemm_epilogue_gpu.py
            step sanitizer-epilogue compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_epilogue_gpu.py -k "sanitizer"
            STEP_TIMEOUT=240 step bench-fusion python3 benchmarks/bench_fusion.py --out "$OUT/bench" ;;
        fusion-one-tile)  # gate-first bf16 TMA tiles as one 4-D descriptor tile (GATE_UP_TMA=one_tile): exactness,
            # sanitizer, then whole calls with the epilogue forced on vs off for the bf16 presets
            STEP_TIMEOUT=300 step test-epilogue python3 -m pytest -q -n 4 -m gpu tests/test_gemm_epilogue_gpu.py
            step sanitizer-epilogue compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_epilogue_gpu.py -k "sanitizer"
            STEP_TIMEOUT=240 step bench-fusion-one-tile python3 benchmarks/bench_fusion.py --gate-up-tile one_tile \
                --cases dsv4-flash:bf16,qwen3-30b-a3b:bf16,mixtral-8x7b:bf16 --rounds 5 --out "$OUT/bench-one-tile" ;;
        fusion-final)  # the final epilogue build as one: exactness of both gate-first tile arrangements, sanitizer,
            # whole calls (bf16 presets: both arrangements and two steps in one run), then where Qwen3's HF decode step goes
            STEP_TIMEOUT=240 step test-epilogue python3 -m pytest -q -n 4 -m gpu tests/test_gemm_epilogue_gpu.py
            step sanitizer-epilogue compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_epilogue_gpu.py -k "sanitizer"
            STEP_TIMEOUT=150 step bench-fusion-bf16 python3 benchmarks/bench_fusion.py --gate-up-tile both \
                --cases dsv4-flash:bf16,qwen3-30b-a3b:bf16,mixtral-8x7b:bf16 --out "$OUT/bench-fusion-bf16"
            STEP_TIMEOUT=100 step bench-fusion-mx python3 benchmarks/bench_fusion.py \
                --cases gpt-oss-120b:mxfp4,dsv4-flash:mxfp4 --out "$OUT/bench-fusion-mx" ;;
        hf-profile)  # kernels of the captured HF decode step per implementation (Qwen3-MoE b1 and b32)
            STEP_TIMEOUT=150 step profile-hf-b1 python3 benchmarks/profile_hf.py --models qwen3_moe --batch 1
            STEP_TIMEOUT=100 step profile-hf-b32 python3 benchmarks/profile_hf.py --models qwen3_moe --batch 32 ;;
        decode-tma)  # decode GEMM1 weights by TMA on wgmma's M side: decode GPU tests, sanitizer, both reads side by
            # side on every preset, the tile sweep on Qwen3-MoE, HF graph decode steps (issue 18's column)
            STEP_TIMEOUT=240 step test-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py tests/test_launch_plan_gpu.py
            step sanitizer-decode compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k sanitizer
            STEP_TIMEOUT=150 step bench-decode-reads python3 benchmarks/bench_decode.py --ab read --out "$OUT/bench-decode"
            STEP_TIMEOUT=100 step bench-decode-sweep python3 benchmarks/bench_decode.py --presets qwen3-30b-a3b --sweep \
                --out "$OUT/bench-decode-sweep"
            STEP_TIMEOUT=200 step bench-hf-graph python3 benchmarks/bench_hf.py --models qwen3_moe,gpt_oss \
                --columns graph_b1,graph_b32 --out "$OUT/bench-hf" ;;
        decode-ktail)  # decode GEMM1's K step dividing K (GPT-OSS bf16: BK 64): decode GPU tests, the cold-L2 decode
            # probe, HF graph decode steps, the decode table, sanitizer incl. a GPT-OSS-width call (K = 2880)
            STEP_TIMEOUT=240 step test-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py
            STEP_TIMEOUT=150 step decode-cold python3 scripts/decode_cold_probe.py --no-pure-reads \
                --cases qwen3-30b-a3b:bf16,gpt-oss-120b:bf16 --out "$OUT/decode-cold.json"
            STEP_TIMEOUT=200 step bench-hf-graph python3 benchmarks/bench_hf.py --models qwen3_moe,gpt_oss,mixtral \
                --columns graph_b1,graph_b32 --out /tmp/bench-hf
            STEP_TIMEOUT=200 step bench-decode python3 benchmarks/bench_decode.py --out /tmp/bench-decode
            STEP_TIMEOUT=${SANITIZER_S:-300} step sanitizer-decode compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_decode_gpu.py -k "sanitizer or (model_shapes and gpt-oss-120b-1)" ;;
        half-tail-ab)  # GemmConfig.half_tail against the table entry on whole calls, alternating rounds, where
            # experts' last 128-row tiles hold few rows (192-256 mean rows per expert, and 2048)
            for run in "gpt-oss-120b mxfp4 medium 8192" "dsv4-flash bf16 medium 8192" "mixtral-8x7b bf16 medium 1024" \
                       "qwen3-30b-a3b bf16 medium 4096,8192" "dsv4-flash mxfp4 medium 8192" "mixtral-8x7b bf16 prefill 8192"; do
                set -- $run
                STEP_TIMEOUT=150 step "ab-half-$1-$2-$3" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights "$2" \
                    --regime "$3" --tokens "$4" --candidates half --rounds 3 --out "/tmp/ab-half-$1-$2-$3"
            done ;;
        half-tail)  # GemmConfig.half_tail (the prepared-MXFP4 medium entry's): GPU tests against the reference and the
            # full tiles' bits, the medium-regime boundary suite, sanitizer, whole calls with and without it at 72-256
            # mean rows, the MXFP4 peers at 8192 tokens
            STEP_TIMEOUT=300 step test-half-tail python3 -m pytest -q -n 2 -m gpu tests/test_gemm_gpu.py \
                tests/test_experts_gpu.py -k "half_tail or medium_regime"
            STEP_TIMEOUT=200 step sanitizer-half-tail compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
                -q -m gpu tests/test_gemm_gpu.py -k "half_tail and ((gpt_oss and w13) or (prefill and w2 and indexed))" ;;
        half-small)  # GemmConfig.half_tail on the prepared-MXFP4 small and decode entries (32- and 64-row tiles whose
            # rows fit in half: 1-32 rows per expert pad to the tile's MMA width) against the table, alternating rounds
            for run in "gpt-oss-120b small 1024" "gpt-oss-120b decode 16,128" "dsv4-flash decode 128,1024" \
                       "dsv4-flash small 2048"; do
                set -- $run
                STEP_TIMEOUT=150 step "ab-half-$1-$2" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                    --regime "$2" --tokens "$3" --candidates half --rounds 5 --out "/tmp/ab-half-$1-$2"
            done ;;
        half-small-check)  # half tiles on the prepared-MXFP4 small entry (the table's): GPU tests against the reference and
            # the full tiles' bits, the MXFP4 experts and epilogue suites, sanitizer, then the MXFP4 peers (all token counts)
            STEP_TIMEOUT=300 step test-half-small python3 -m pytest -q -n 2 -m gpu tests/test_gemm_gpu.py \
                tests/test_experts_gpu.py tests/test_gemm_epilogue_gpu.py \
                -k "(switch and half_tail and BM64) or (experts_gpu and (mxfp4 or gpt)) or (mxfp4_model_shapes and small)"
            STEP_TIMEOUT=200 step sanitizer-half-small compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
                -q -m gpu tests/test_gemm_gpu.py -k "hopper_small_sanitizer or (switch and half_tail and BM64 and gpt_oss and w13)"
            if [ -d .peers ]; then
                STEP_TIMEOUT=260 step peers-mx env OUT="$OUT/peers" BUDGET_S=230 TIMEOUT_S=250 bash .peers/run.sh \
                    --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx --impls padded_moe,triton_kernels
            fi ;;
        half-tail-bench)  # the prepared-MXFP4 medium entry with and without half_tail at 72-128 mean rows, the MXFP4
            # peers at 8192 tokens
            for run in "gpt-oss-120b 2304,3072,4096" "dsv4-flash 3072,4096"; do
                set -- $run
                STEP_TIMEOUT=150 step "ab-half-$1" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                    --regime medium --tokens "$2" --candidates half --rounds 3 --out "/tmp/ab-half-$1"
            done
            if [ -d .peers ]; then
                STEP_TIMEOUT=200 step peers env OUT=/tmp/peers BUDGET_S=170 TIMEOUT_S=190 bash .peers/run.sh \
                    --tokens 8192 --cases gptoss,dsv4mx --impls padded_moe,triton_kernels
            fi ;;
        dynamic)  # GemmConfig.dynamic (persistent programs take tiles from a device counter, in order): the switch
            # GPU tests, sanitizer, then whole bf16 calls with the table's static walk against the counter, with and
            # without half tiles (half tiles lost on bf16 inside the static persistent walk)
            STEP_TIMEOUT=200 step test-dynamic python3 -m pytest -q -n 2 -m gpu tests/test_gemm_gpu.py -k "switch and dynamic"
            STEP_TIMEOUT=200 step sanitizer-dynamic compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
                -q -m gpu tests/test_gemm_gpu.py -k "switch and dynamic and (gpt_oss or dsv4) and w13"
            for run in "dsv4-flash medium 8192" "mixtral-8x7b medium 1024" "qwen3-30b-a3b medium 4096,8192" \
                       "mixtral-8x7b prefill 8192"; do
                set -- $run
                if [ "$2" = medium ]; then t=BM128_BN256_BK64_G16_w8_s4_tma_pers; else t=BM128_BN256_BK64_G8_w8_s4_tma_pers; fi
                STEP_TIMEOUT=150 step "ab-dyn-$1-$2" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights bf16 \
                    --regime "$2" --tokens "$3" --candidates "${t}_dyn,${t}_half,${t}_half_dyn" --rounds 3 \
                    --out "/tmp/ab-dyn-$1-$2"
            done ;;
        cutlass-mx)  # CUTLASS's sm90 mixed-input GEMM on e2m1 (64-element scale groups, speed only) against our
            # prepared-MXFP4 GEMM and torch's bf16 bmm (issue 12's warp-specialization question); needs the
            # library built by scripts/cutlass_mx/build.sh and carried (.cutlass_mx)
            STEP_TIMEOUT=240 step cutlass-mx python3 scripts/cutlass_mx_probe.py --out "$OUT/cutlass-mx.json" ;;
        mx-decode-cuda)  # the hand-written sm_90 MXFP4 decode GEMM (mma.sync) against the library's decode kernels,
            # cold L2 (issue 12's decode target); needs scripts/mx_decode_cuda/build.sh's library carried (.mx_decode_cuda)
            STEP_TIMEOUT=${MXD_TIMEOUT:-300} step mx-decode-cuda python3 scripts/mx_decode_cuda_probe.py --out "$OUT/mx-decode-cuda.json" ;;
        decode-ncu)  # Nsight Compute sections and stall reasons of the library's prepared-MXFP4 GEMMs (Triton) in a
            # GPT-OSS layer call at DECODE_TOKENS (128: 4 rows per expert, where #12's target is short), GEMM1 and GEMM2
            STEP_TIMEOUT=200 step ncu-decode ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                --section WarpStateStats --section SchedulerStats --section LaunchStats \
                --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:_expert_gemm" \
                --launch-skip 4 --launch-count 2 python3 scripts/ncu_small.py layer gpt-oss-120b:mxfp4 "${DECODE_TOKENS:-128}" ;;
        decode-tiles)  # the prepared-MXFP4 decode tile (250 registers: 2 blocks of 4 warps per SM, decode-ncu) against
            # the same tile on 8 warps (128 registers), BK 128 (134 registers, 3 blocks) and BN 256 BK 128 on 8 warps
            # (136 registers), whole calls in alternating rounds (bench_tiles_ab.py checks each output against the
            # table tile's); DECODE_TILES: other candidates
            for preset in gpt-oss-120b dsv4-flash; do
                STEP_TIMEOUT=200 step "decode-tiles-$preset" python3 benchmarks/bench_tiles_ab.py --preset "$preset" \
                    --weights mxfp4 --tokens 128,1024 --regime decode --out "$OUT/bench/decode-tiles-$preset" --candidates \
                    "${DECODE_TILES:-BM32_BN128_BK256_G1_w4_s3_hop_ptx,BM32_BN128_BK256_G1_w8_s3_hop_ptx,BM32_BN128_BK128_G1_w4_s4_hop_ptx,BM32_BN256_BK128_G1_w8_s3_hop_ptx}"
            done ;;
        mx-upcast)  # the prepared-MXFP4 upcast (its scale a 16-bit operand of the inline PTX): the decode kernels' and the
            # experts suite's MXFP4 GPU tests, memcheck of the small cases, then the prepared GEMM's GPU tests
            STEP_TIMEOUT=150 step test-decode-mx python3 -m pytest -q -m gpu tests/test_decode_gpu.py tests/test_experts_gpu.py \
                -k "mxfp4 or mx or hopper"
            STEP_TIMEOUT=120 step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
                -m gpu tests/test_gemm_gpu.py tests/test_decode_gpu.py -k "hopper_small_sanitizer or sanitizer"
            STEP_TIMEOUT=330 step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "hopper and not big_tiles" ;;
        native-build)  # the native libraries' first build as a user meets it, in a fresh cache: the grouped GEMM's
            # source compiled by nvcc without -split-compile (the old flags) for the time, then `padded-moe
            # build-native` (the package's flags), then the GPU tests of the native kernels on that build
            export PADDED_MOE_CACHE_DIR=/tmp/pmoe-fresh-cache
            rm -rf "$PADDED_MOE_CACHE_DIR"
            STEP_TIMEOUT=200 step build-one-thread bash -c 'time python3 -c "
from pathlib import Path
from padded_moe.kernels.native import GROUPED as lib
i = lib.flags.index(\"-split-compile\")
lib.flags = lib.flags[:i] + lib.flags[i + 2:]
lib.build(Path(\"/tmp/one-thread.so\"))"'
            STEP_TIMEOUT=200 step build-native bash -c 'time python3 -m padded_moe build-native'
            STEP_TIMEOUT=${NATIVE_TESTS_S:-300} step test-native-build python3 -m pytest -q -m gpu \
                tests/test_native_grouped_gpu.py -k "not sanitizer"
            STEP_TIMEOUT=120 step test-native-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py -k native ;;
        trees-ab)  # whole calls of two source trees in alternating rounds (bench_trees_ab.py): AB_TREE (default .ab/main,
            # carried) against this tree on GPT-OSS and DeepSeek-V4 MXFP4 (AB_GPT_TOKENS, AB_DSV4_TOKENS)
            STEP_TIMEOUT=270 step trees-ab-gpt-oss python3 benchmarks/bench_trees_ab.py --tree-a "${AB_TREE:-.ab/main}" \
                --tree-b . --preset gpt-oss-120b --weights mxfp4 --tokens "${AB_GPT_TOKENS:-1,16,128,1024,8192}" --out "$OUT/bench/trees-ab-gpt-oss"
            STEP_TIMEOUT=220 step trees-ab-dsv4 python3 benchmarks/bench_trees_ab.py --tree-a "${AB_TREE:-.ab/main}" \
                --tree-b . --preset dsv4-flash --weights mxfp4 --tokens "${AB_DSV4_TOKENS:-1,128,1024}" \
                --out "$OUT/bench/trees-ab-dsv4" ;;
        walk-end)  # the dynamic walk's end (publish_walk_end, plain and gathering producers): the native kernels'
            # dynamic-walk and gather GPU tests against float64 and bit for bit, then memcheck of their small cases
            STEP_TIMEOUT=300 step test-walk-end python3 -m pytest -q -m gpu tests/test_native_grouped_gpu.py \
                -k "(every_config and dynamic) or stages_and_chunks or gather or graph_replay"
            STEP_TIMEOUT=200 step sanitizer-walk-end compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
                -q -m gpu tests/test_native_grouped_gpu.py -k "sanitizer" ;;
        mx-decode-ncu)  # Nsight Compute sections and stall reasons of configurations of that kernel and of the
            # library's decode GEMM1 (GPT-OSS; MXD_TOKENS and MXD_CONFIGS choose the call and the configurations)
            ncu_sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
                          --section WarpStateStats --section SchedulerStats --section LaunchStats
                          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
            STEP_TIMEOUT=200 step ncu-mx-decode ncu "${ncu_sections[@]}" -k "regex:mx_decode|decode_w13" \
                python3 scripts/mx_decode_cuda_probe.py --cases gpt-oss-120b --tokens "gpt-oss-120b:${MXD_TOKENS:-4}" \
                --layers 1 --ncu "${MXD_CONFIGS:-wn4_ks1_d2_ld0_t2,wn4_ks2_d4_ld0_t2}" ;;
        native-w2)  # the native (CUDA C++) MXFP4 decode GEMM2: its build, the MXFP4 decode tests (both GEMM2 kernels),
            # plans, memcheck, the configurations side by side and on cold L2, the peers at 1 and 16 tokens (carry .peers)
            step test-native python3 -m pytest -q tests/test_native.py
            step test-native-gpu python3 -m pytest -q -m gpu tests/test_decode_gpu.py -k "native or mxfp4"
            step test-native-plans python3 -m pytest -q -m gpu tests/test_launch_plan_gpu.py -k "mxfp4"
            step sanitizer-native compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k "sanitizer and mxfp4-prepared"
            STEP_TIMEOUT=200 step bench-decode-mxw2 python3 benchmarks/bench_decode.py --weights mxfp4 \
                --presets gpt-oss-120b,dsv4-flash --ab mxw2 --out "$OUT/bench-decode-mxw2"
            STEP_TIMEOUT=120 step decode-cold-mx python3 scripts/decode_cold_probe.py \
                --cases gpt-oss-120b:mxfp4,dsv4-flash:mxfp4 --out "$OUT/decode-cold-mx.json"
            if [ -d .peers ]; then
                STEP_TIMEOUT=200 step peers env OUT="$OUT/peers" BUDGET_S=150 TIMEOUT_S=190 bash .peers/run.sh \
                    --tokens 1,16 --cases gptoss,dsv4mx
            fi ;;
        small-kernels)  # the activation's launch shapes (incl. one program per row block) and Nsight Compute
            # sections of the activation (ours vs torch.compile's kernel) and of unpermute (indexed vs grouped)
            STEP_TIMEOUT=150 step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench-activation" ;&
        ncu-small)  # small-kernels' Nsight Compute part alone
            ncu_sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
                          --section WarpStateStats --section LaunchStats)
            STEP_TIMEOUT=120 step ncu-activation ncu "${ncu_sections[@]}" -k "regex:moe_activation|triton_poi|_striding_kernel" \
                --launch-count 6 python3 scripts/ncu_small.py act
            STEP_TIMEOUT=120 step ncu-unpermute ncu "${ncu_sections[@]}" -k "regex:_unpermute" --launch-count 6 \
                python3 scripts/ncu_small.py unpermute ;;
        ncu-bytes)  # busy SM cycles, DRAM bytes and L2 hit rate of Triton vs the native configuration 0 (GEMM1 at
            # 8192 tokens, NCU_PRESETS; NCU_LAUNCHES=3 adds c0 from the counter: ncu_small.py's order), then the
            # native kernel's top stall locations (SourceCounters: stayed on its first pass in run 245)
            for pc in ${NCU_PRESETS:-qwen3-30b-a3b dsv4-flash}; do
                STEP_TIMEOUT=${NCU_STEP_S:-60} step "ncu-bytes-$pc" ncu --metrics \
                    dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__cycles_active.avg,gpc__cycles_elapsed.max \
                    -k regex:"grouped_gemm|_expert_gemm" --launch-count "${NCU_LAUNCHES:-2}" python3 scripts/ncu_small.py native "$pc" 8192 w13
            done
            STEP_TIMEOUT=${NCU_STEP_S:-60} step ncu-source ncu --section SourceCounters -k regex:grouped_gemm --launch-count 1 \
                python3 scripts/ncu_small.py native qwen3-30b-a3b 8192 w13 ;;
        ncu-split)  # Nsight Compute of Qwen3-MoE's GEMM1 at 8192 tokens, Triton then the native configuration 0, one
            # section group per step under kernel replay (LaunchStats, SpeedOfLight and WarpStateStats profile the
            # native kernel; MemoryWorkloadAnalysis and SourceCounters stay on its first pass, as the whole set did)
            for sec in SpeedOfLight WarpStateStats MemoryWorkloadAnalysis; do
                extra=(); [ "$sec" = WarpStateStats ] && extra=(--metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
                STEP_TIMEOUT=${NCU_STEP_S:-45} step "ncu-$sec" ncu --section "$sec" "${extra[@]}" -k regex:"grouped_gemm|_expert_gemm" \
                    --launch-count 2 python3 scripts/ncu_small.py native qwen3-30b-a3b 8192 w13
            done ;;
        ncu-native)  # Nsight Compute of one full-tile GEMM each: Triton vs the native kernel's configurations 0
            # and 3 (where the native kernel loses to Triton: its tensor-pipe share, stalls, shared-memory traffic)
            ncu_native ${NCU_NATIVE_CASES:-mixtral-8x7b:8192:w2 qwen3-30b-a3b:8192:w13 dsv4-flash:8192:w13} ;;
        ncu-gemm)  # Nsight Compute of the bf16 expert GEMMs at DeepSeek-V4 8192 tokens (third call: GEMM1, GEMM2)
            # and of a dense cuBLAS matmul of GEMM1's rows (the tensor-pipe and DRAM reference)
            ncu_sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
                          --section Occupancy --section WarpStateStats --section LaunchStats
                          --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum)
            STEP_TIMEOUT=200 step ncu-gemm-dsv4 ncu "${ncu_sections[@]}" -k "regex:_expert_gemm" --launch-skip 4 \
                --launch-count 2 python3 scripts/ncu_small.py layer dsv4-flash 8192
            STEP_TIMEOUT=120 step ncu-mm ncu "${ncu_sections[@]}" --launch-skip 3 --launch-count 1 \
                python3 scripts/ncu_small.py mm 49152 4096 4096 ;;
        tile192)  # probe: one program over an expert's 192 rows vs two 128-row m-tiles (issue 14)
            STEP_TIMEOUT=300 step tile192 python3 scripts/tile192_probe.py
            STEP_TIMEOUT=200 step tile192-r160 python3 scripts/tile192_probe.py --rows 160 ;;
        ncu-gemm-variants)  # the same GEMMs with the tile walk varied: dynamic counter, one program per tile
            for c in BM128_BN256_BK64_G16_w8_s4_tma_pers_dyn BM128_BN256_BK64_G16_w8_s4_tma BM128_BN256_BK64_G8_w8_s4_tma_pers \
                     BM128_BN256_BK64_G32_w8_s4_tma_pers; do
                STEP_TIMEOUT=120 step "ncu-gemm-$c" ncu --section SpeedOfLight \
                    --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct -k "regex:_expert_gemm" --launch-skip 4 \
                    --launch-count 2 python3 scripts/ncu_small.py layer dsv4-flash 8192 "$c"
            done ;;
        striding)  # grid-striding kernels sized to one wave of resident programs: the driver's occupancy
            # cross-check, the activation / layout / plan GPU tests, sanitizer, both benches
            STEP_TIMEOUT=200 step test-striding python3 -m pytest -q -n 2 -m gpu tests/test_platform_gpu.py \
                tests/test_activation_gpu.py tests/test_layouts_gpu.py tests/test_launch_plan_gpu.py
            step sanitizer-layouts compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_layouts_gpu.py tests/test_platform_gpu.py -k "sanitizer or wave"
            STEP_TIMEOUT=150 step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench-activation"
            STEP_TIMEOUT=100 step bench-permute python3 benchmarks/bench_permute.py --out "$OUT/bench-permute" ;;
        striding-final)  # the activation's launch shapes for silu and situ, then the suites that call the
            # striding kernels through fused_experts (eager, plans, compile) and the HF parity tests
            STEP_TIMEOUT=150 step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench-activation"
            STEP_TIMEOUT=200 step test-experts-compile python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py \
                tests/test_compile_gpu.py
            STEP_TIMEOUT=120 step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py ;;
        owed-gpu)  # the activation's row loop in 32 bits: its GPU tests, memcheck (counts 0, 1, half, T, past T,
            # negative; int32 and int64 counts), the launch-shape bench, the suites that call it; the native
            # GEMM2 with each slot's expert guarded once (shared memory): its tests and memcheck
            step test-native python3 -m pytest -q tests/test_native.py
            step test-native-gpu python3 -m pytest -q -m gpu tests/test_decode_gpu.py -k "native or mxfp4"
            step sanitizer-native compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k "sanitizer and mxfp4-prepared"
            STEP_TIMEOUT=90 step test-activation python3 -m pytest -q -m gpu tests/test_activation_gpu.py
            STEP_TIMEOUT=240 step sanitizer-activation compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_activation_gpu.py -k "bfloat16 and (silu or swigluoai or situ)"
            STEP_TIMEOUT=150 step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench-activation"
            STEP_TIMEOUT=120 step act-probe python3 scripts/act_variants_probe.py --tunings 4096:2048:8:4096 \
                --only lib,striding_p32,striding_fastsig,striding_expsig --out "$OUT/act-variants.json"
            STEP_TIMEOUT=180 step test-experts-compile python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py \
                tests/test_compile_gpu.py
            STEP_TIMEOUT=120 step test-docs python3 -m pytest -q tests/test_docs_examples.py ;;  # incl. the CUDA-graph example
        silu-plain)  # plain silu's kernel branch (no alpha / beta operations): the activation's GPU tests and
            # memcheck, its bench, the probe (the library kernel with tanh.approx and exp sigmoids next to the
            # probe's form), the decode kernels' and the layout GEMM's fused activation
            STEP_TIMEOUT=90 step test-activation python3 -m pytest -q -m gpu tests/test_activation_gpu.py
            STEP_TIMEOUT=120 step sanitizer-activation compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_activation_gpu.py -k "bfloat16 and (silu or swigluoai or situ)"
            STEP_TIMEOUT=100 step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench-activation"
            STEP_TIMEOUT=90 step act-probe python3 scripts/act_variants_probe.py \
                --only lib,striding_p32,striding_fastsig,striding_expsig_p32 --out "$OUT/act-variants.json"
            STEP_TIMEOUT=140 step test-decode python3 -m pytest -q -n 2 -m gpu tests/test_decode_gpu.py
            STEP_TIMEOUT=140 step test-experts python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py ;;
        silu-tile)  # plain silu's 4 x 2048 tiles (TUNING_BY_ACTIVATION): the activation's GPU tests and memcheck,
            # its bench (the docs' table), the layout path's suites that launch it
            STEP_TIMEOUT=90 step test-activation python3 -m pytest -q -m gpu tests/test_activation_gpu.py
            STEP_TIMEOUT=120 step sanitizer-activation compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_activation_gpu.py -k "bfloat16 and (silu or swigluoai or situ)"
            STEP_TIMEOUT=100 step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench-activation"
            STEP_TIMEOUT=140 step test-experts python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py
            STEP_TIMEOUT=120 step test-no-sync python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k never_syncs ;;
        act-pairs)  # interleaved gate/up rows loaded as one contiguous run (16-byte loads) and column blocks sized
            # to the width: the activation's GPU tests and memcheck, its bench (model widths), the GPT-OSS
            # MXFP4 layer's kernels at 8192 tokens, the activation in GEMM1's 256-row epilogue against it
            STEP_TIMEOUT=90 step test-activation python3 -m pytest -q -m gpu tests/test_activation_gpu.py
            STEP_TIMEOUT=120 step sanitizer-activation compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_activation_gpu.py -k "bfloat16 and (silu or swigluoai or situ)"
            STEP_TIMEOUT=120 step bench-activation python3 benchmarks/bench_activation.py --out "$OUT/bench-activation"
            STEP_TIMEOUT=120 step profile-gptoss-mx python3 benchmarks/profile_layer.py --graph --preset gpt-oss-120b \
                --weights mxfp4 --tokens 8192 --calls 3
            for pw in gpt-oss-120b dsv4-flash; do
                STEP_TIMEOUT=150 step "fuse-ab-$pw" python3 benchmarks/bench_tiles_ab.py --preset "$pw" --weights mxfp4 \
                    --tokens 8192 --regime medium --candidates persistent --fuse-activation both --rounds 3 \
                    --out "$OUT/fuse-ab-$pw"
            done ;;
        router-ds)  # DeepSeek-V3 / V4 routing in one kernel (biased_grouped_topk on CUDA): its GPU tests and memcheck,
            # the suites whose FusedMoE routes through it (compiled and eager), the routers' bench, the
            # DeepSeek-V4 layer's kernels at 1 and 8192 tokens
            STEP_TIMEOUT=90 step test-routing python3 -m pytest -q -m gpu tests/test_routing_gpu.py
            STEP_TIMEOUT=120 step sanitizer-routing compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_routing_gpu.py -k "biased_kernel or fused_topk"
            STEP_TIMEOUT=170 step test-compile python3 -m pytest -q -n 2 -m gpu tests/test_compile_gpu.py
            STEP_TIMEOUT=170 step test-experts python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py
            STEP_TIMEOUT=120 step bench-router python3 benchmarks/bench_router.py --out "$OUT/bench-router"
            STEP_TIMEOUT=120 step profile-dsv4 python3 benchmarks/profile_layer.py --graph --preset dsv4-flash \
                --weights bf16 --tokens 1 8192 --calls 3 ;;
        layer-table)  # the whole-layer table (FusedMoE vs HF's experts functions), MXFP4 presets included (needs the
            # carried transformers wheel for the HF columns)
            STEP_TIMEOUT=420 step bench-layer python3 benchmarks/bench_layer.py --out "$OUT/bench-layer" \
                --presets dsv4-flash:bf16,qwen3-30b-a3b:bf16,dsv4-flash:mxfp4,gpt-oss-120b:mxfp4 ;;
        mx-once)  # MXFP4 experts held in the prepared form alone (prepare_for(keep_canonical=False), FusedMoE's
            # default): the suites that run MXFP4 through fused_experts, FusedMoE, the decode path, compile, HF
            STEP_TIMEOUT=170 step test-experts python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py
            STEP_TIMEOUT=170 step test-decode python3 -m pytest -q -n 2 -m gpu tests/test_decode_gpu.py -k mxfp4
            STEP_TIMEOUT=150 step test-compile python3 -m pytest -q -n 2 -m gpu tests/test_compile_gpu.py
            STEP_TIMEOUT=100 step test-docs python3 -m pytest -q tests/test_docs_examples.py ;;
        router)  # the one-kernel top-k (routing.fused_topk; the HF plug-in's Mixtral / Qwen3-MoE / OLMoE / GPT-OSS
            # routers): its GPU tests, the suites that route through it, HF parity, HF graph decode steps
            STEP_TIMEOUT=90 step test-routing python3 -m pytest -q -m gpu tests/test_routing_gpu.py
            STEP_TIMEOUT=150 step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py
            STEP_TIMEOUT=150 step test-compile python3 -m pytest -q -n 2 -m gpu tests/test_compile_gpu.py
            STEP_TIMEOUT=240 step bench-hf-graph python3 benchmarks/bench_hf.py --models qwen3_moe,gpt_oss,mixtral \
                --columns graph_b1,graph_b32,decode_b1 --out "$OUT/bench-hf" ;;
        router-v3|router-v3-tests)  # the HF plug-in's DeepSeek routers (V3 / V3.2, GLM-4-MoE; V4 with its steps
            # rounded to bfloat16) through biased_grouped_topk with int64 indices: GPU router tests (incl. V4's bf16
            # steps against transformers' CUDA router) and memcheck, HF parity (deepseek_v3 joined it), compile,
            # the two-GPU example; router-v3 also times the DeepSeek-V3- and V4-like HF models' graph and eager
            # decode steps
            STEP_TIMEOUT=90 step test-routing python3 -m pytest -q -m gpu tests/test_routing_gpu.py
            STEP_TIMEOUT=120 step sanitizer-routing compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_routing_gpu.py -k "biased_kernel or bf16_steps"
            STEP_TIMEOUT=150 step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py
            STEP_TIMEOUT=200 step test-compile python3 -m pytest -q -n 2 -m gpu tests/test_compile_gpu.py
            STEP_TIMEOUT=150 step example-ep-cuda python3 -m torch.distributed.run --standalone --nproc-per-node \
                "$(python3 -c 'import torch; print(min(2, torch.cuda.device_count()))')" examples/expert_parallel.py --cuda
            if [ "$stage" = router-v3 ]; then
                STEP_TIMEOUT=300 step bench-hf-ds python3 benchmarks/bench_hf.py --models deepseek_v3,deepseek_v4 \
                    --columns graph_b1,graph_b32,decode_b1,decode_b32 --out "$OUT/bench-hf-ds"
            fi ;;
        pipeline-suites)  # the kernels every fused_experts call runs outside the GEMMs (activation, layouts'
            # unpermute) through the suites that call fused_experts (decode, plans, eager, compile, HF parity)
            STEP_TIMEOUT=90 step test-activation python3 -m pytest -q -m gpu tests/test_activation_gpu.py
            STEP_TIMEOUT=150 step test-decode-plans python3 -m pytest -q -n 2 -m gpu tests/test_decode_gpu.py \
                tests/test_launch_plan_gpu.py
            STEP_TIMEOUT=180 step test-experts-compile python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py \
                tests/test_compile_gpu.py
            STEP_TIMEOUT=100 step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py ;;
        ws-probe)  # whether Triton's automatic warp specialization runs here (each variant under a timeout)
            STEP_TIMEOUT=420 step ws-probe python3 scripts/ws_probe.py --timeout 45 ;;
        experts-owed)  # the fused_experts GPU suite alone (the Kimi preset's float64 reference is large)
            STEP_TIMEOUT=240 step test-experts python3 -m pytest -q -m gpu tests/test_experts_gpu.py ;;
        final-suites)  # the session's end state: the GEMM and decode kernels' GPU tests, the suites that call
            # fused_experts (eager, plans, compile) and the HF parity tests
            STEP_TIMEOUT=120 step test-epilogue python3 -m pytest -q -n 4 -m gpu tests/test_gemm_epilogue_gpu.py
            STEP_TIMEOUT=150 step test-decode-plans python3 -m pytest -q -n 2 -m gpu tests/test_decode_gpu.py \
                tests/test_launch_plan_gpu.py
            STEP_TIMEOUT=150 step test-experts-compile python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py \
                tests/test_compile_gpu.py
            STEP_TIMEOUT=100 step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py ;;
        fusion-suites)  # the GPU suites that call fused_experts (now with the epilogue), then the peers table
            STEP_TIMEOUT=180 step test-pipeline python3 -m pytest -q -n 4 -m gpu tests/test_experts_gpu.py \
                tests/test_launch_plan_gpu.py tests/test_decode_gpu.py tests/test_compile_gpu.py
            if [ -d .peers ]; then
                STEP_TIMEOUT=380 step peers env OUT="$OUT/peers" BUDGET_S=330 TIMEOUT_S=370 bash .peers/run.sh \
                    --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx,dsv4,qwen3,mixtral --check-tokens 64,1024
            fi ;;
        peers-all)  # the peers table of record: all five cases in one run
            if [ -d .peers ]; then
                STEP_TIMEOUT=420 step peers env OUT="$OUT/peers" BUDGET_S=380 TIMEOUT_S=410 bash .peers/run.sh \
                    --tokens 1,16,128,1024,8192 --cases gptoss,dsv4mx,dsv4,qwen3,mixtral --check-tokens 64,1024
            fi ;;
        tiles-ab)  # prepared-MXFP4 tile candidates on whole GPT-OSS calls, alternating rounds: decode at 128 tokens
            # (BK 256 stages/warps, the table at 1.18x triton_kernels there), small at 1024
            step ab-decode python3 benchmarks/bench_tiles_ab.py --preset gpt-oss-120b --weights mxfp4 --tokens 16,128 \
                --regime decode --candidates BM32_BN128_BK128_G1_w4_s3_hop_ptx,BM32_BN128_BK256_G1_w4_s2_hop_ptx,BM32_BN256_BK128_G1_w8_s3_hop_ptx,BM16_BN128_BK256_G1_w4_s3_hop_ptx \
                --out "$OUT/ab-decode"
            step ab-small python3 benchmarks/bench_tiles_ab.py --preset gpt-oss-120b --weights mxfp4 --tokens 1024 \
                --regime small --candidates BM64_BN128_BK128_G4_w4_s3_hop_ptx,BM64_BN128_BK128_G4_w4_s4_hop_ptx,BM64_BN256_BK64_G4_w8_s3_hop_ptx \
                --out "$OUT/ab-small" ;;
        small-cap)  # the prepared-MXFP4 small tile with and without a 168-register cap (GemmConfig.maxnreg, 3 blocks
            # per SM where ptxas takes 170 registers) on whole calls in the small regime, alternating rounds
            STEP_TIMEOUT=160 step ab-small-cap-gpt-oss python3 benchmarks/bench_tiles_ab.py --preset gpt-oss-120b \
                --weights mxfp4 --tokens 1024 --regime small \
                --candidates BM64_BN128_BK64_G4_w4_s4_hop_ptx_half,BM64_BN128_BK64_G4_w4_s4_hop_ptx_half_r168 \
                --out "$OUT/ab-small-cap-gpt-oss"
            STEP_TIMEOUT=160 step ab-small-cap-dsv4 python3 benchmarks/bench_tiles_ab.py --preset dsv4-flash \
                --weights mxfp4 --tokens 2048 --regime small \
                --candidates BM64_BN128_BK64_G4_w4_s4_hop_ptx_half,BM64_BN128_BK64_G4_w4_s4_hop_ptx_half_r168 \
                --out "$OUT/ab-small-cap-dsv4" ;;
        persistent)  # GemmConfig.persistent: GPU tests (bits of one program per tile, graphs), then each
            # medium / prefill table entry against its persistent form on whole calls, alternating rounds
            STEP_TIMEOUT=400 step test-persistent python3 -m pytest -q -n 2 -m gpu tests/test_gemm_gpu.py -k persistent
            for run in "dsv4-flash bf16 medium 4096,8192" "mixtral-8x7b bf16 prefill 4096,8192" \
                       "mixtral-8x7b bf16 medium 1024" "qwen3-30b-a3b bf16 medium 4096,8192" \
                       "gpt-oss-120b mxfp4 medium 8192" "dsv4-flash mxfp4 medium 8192"; do
                set -- $run
                STEP_TIMEOUT=240 step "ab-pers-$1-$2-$3" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights "$2" \
                    --regime "$3" --tokens "$4" --candidates persistent --rounds 3 --out "$OUT/ab-pers-$1-$2-$3"
            done ;;
        persistent-final)  # persistent bf16 medium/prefill tiles as the table's: GPU tests, sanitizer, the suites
            # that call fused_experts, then the bf16 peers at 1024 / 8192 tokens
            STEP_TIMEOUT=200 step test-persistent python3 -m pytest -q -n 2 -m gpu tests/test_gemm_gpu.py -k persistent
            step sanitizer-persistent compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k persistent_graph_replay
            STEP_TIMEOUT=150 step test-epilogue python3 -m pytest -q -n 4 -m gpu tests/test_gemm_epilogue_gpu.py
            STEP_TIMEOUT=180 step test-experts-compile python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py \
                tests/test_compile_gpu.py tests/test_launch_plan_gpu.py
            if [ -d .peers ]; then
                STEP_TIMEOUT=300 step peers env OUT="$OUT/peers" BUDGET_S=260 TIMEOUT_S=290 bash .peers/run.sh \
                    --tokens 1024,8192 --cases dsv4,qwen3,mixtral --check-tokens 1024
            fi ;;
        persistent-small)  # the small-regime table entries (33-71 rows per expert) against their persistent form
            for run in "qwen3-30b-a3b bf16 small 1024" "dsv4-flash bf16 small 2048" \
                       "gpt-oss-120b mxfp4 small 1024,2048" "dsv4-flash mxfp4 small 2048"; do
                set -- $run
                STEP_TIMEOUT=240 step "ab-pers-$1-$2-$3" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights "$2" \
                    --regime "$3" --tokens "$4" --candidates persistent --rounds 5 --out "$OUT/ab-pers-$1-$2-$3"
            done ;;
        persistent-epilogue)  # prepared MXFP4: persistent tiles with the activation in GEMM1's epilogue forced on / off
            # (ptxas serializes the one-program-per-tile kernel's wgmmas with the epilogue, not the persistent one's)
            for run in "gpt-oss-120b mxfp4 medium 8192" "gpt-oss-120b mxfp4 decode 1024" "gpt-oss-120b mxfp4 small 2048" \
                       "dsv4-flash mxfp4 medium 8192"; do
                set -- $run
                STEP_TIMEOUT=240 step "ab-epi-$1-$2-$3" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights "$2" \
                    --regime "$3" --tokens "$4" --candidates persistent --fuse-activation both --rounds 5 \
                    --out "$OUT/ab-epi-$1-$2-$3"
            done ;;
        mx-c7515)  # prepared MXFP4 with its K loop assumed non-empty (no C7515 serialization): GPU tests, the
            # epilogue / persistence A/B on GPT-OSS at 8192 tokens, then the GPT-OSS peers at 1024 / 8192 tokens
            STEP_TIMEOUT=120 step test-hopper python3 -m pytest -q -n 3 -m gpu tests/test_gemm_gpu.py \
                -k "hopper_real_shapes or persistent_graph or cuda_graph_replay"
            STEP_TIMEOUT=120 step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            STEP_TIMEOUT=100 step ab-epi-gpt-oss python3 benchmarks/bench_tiles_ab.py --preset gpt-oss-120b --weights mxfp4 \
                --regime medium --tokens 8192 --candidates persistent --fuse-activation both --rounds 3 --out "$OUT/ab-epi-gpt-oss"
            if [ -d .peers ]; then
                STEP_TIMEOUT=150 step peers env OUT="$OUT/peers" BUDGET_S=120 TIMEOUT_S=140 bash .peers/run.sh \
                    --tokens 1024,8192 --cases gptoss --check-tokens 1024
            fi ;;
        mx-ktail)  # prepared MXFP4 without the per-column K test of the activations where K has no tail: GPU
            # tests (real shapes without a tail, K = 1056 with one), sanitizer, peers of both MXFP4 models
            STEP_TIMEOUT=150 step test-hopper python3 -m pytest -q -n 3 -m gpu tests/test_gemm_gpu.py \
                -k "hopper_real_shapes or persistent_graph or cuda_graph_replay or (every_sweep_config and (indexed or grouped_masked))"
            STEP_TIMEOUT=120 step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            if [ -d .peers ]; then
                STEP_TIMEOUT=200 step peers env OUT="$OUT/peers" BUDGET_S=170 TIMEOUT_S=190 bash .peers/run.sh \
                    --tokens 1024,8192 --cases gptoss,dsv4mx --check-tokens 1024
            fi ;;
        mx-bm256)  # 256-row prepared-MXFP4 tiles (wgmma n256: half the upcast per MAC of the 128-row tile) on
            # 256-row INDEXED blocks: whole calls against the table at 192-512 rows per expert, GPU tests, sanitizer
            table=$(python3 -c "from padded_moe.kernels import gemm as kg; print(kg.TUNED[('mxfp4_hopper4', 'medium')].short())")
            for spec in "gpt-oss-120b 8192,16384" "dsv4-flash 8192,16384"; do
                set -- $spec
                STEP_TIMEOUT=200 step "bm256-$1" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                    --regime medium --tokens "$2" --rounds 5 --out "$OUT/bm256-$1" \
                    --candidates "$table@256,BM256_BN128_BK64_G8_w8_s3_hop_ptx@256,BM256_BN128_BK64_G8_w8_s4_hop_ptx@256,BM256_BN64_BK64_G8_w4_s3_hop_ptx@256"
            done
            STEP_TIMEOUT=150 step test-bm256 python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "256_row_tiles"
            STEP_TIMEOUT=120 step sanitizer-bm256 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "256_row_tiles and 1056 and s3"
            step test-torch-backend python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "torch_backend_cuda" ;;
        mx-blocks)  # prepared MXFP4: 128-row INDEXED blocks in the medium regime (144-192 mean
            # rows per expert): the table at the default block against the tiles at 64- and 128-row blocks,
            # whole calls in alternating rounds; then the peers of the DeepSeek-V4 MXFP4 case at 8192 tokens
            tile() { python3 -c "from padded_moe.kernels import gemm as kg; print(kg.$1[('mxfp4_hopper4', '$2')].short())"; }
            med=$(tile TUNED medium); nar=$(tile TUNED_NARROW medium)
            for spec in "dsv4-flash medium 6144,8192 $nar@64,$med@128" "gpt-oss-120b medium 6144 $nar@64,$med@128"; do
                set -- $spec
                STEP_TIMEOUT=150 step "blocks-$1-$2" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                    --regime "$2" --tokens "$3" --rounds 5 --out "$OUT/blocks-$1-$2" --candidates "$4"
            done
            if [ -d .peers ]; then
                STEP_TIMEOUT=200 step peers env OUT="$OUT/peers" BUDGET_S=150 TIMEOUT_S=190 bash .peers/run.sh \
                    --tokens 8192 --cases dsv4mx,gptoss
            fi ;;
        medium72)  # every weight kind in the medium regime from `BLOCK_128_MEAN_ROWS` (72) rows per expert, INDEXED in
            # 128-row blocks from there: GPU tests (bf16 and prepared MXFP4, INDEXED and GROUPED_CONTIGUOUS around the
            # bound), sanitizer; with a third argument `ab`, whole calls with the table against the small tile
            STEP_TIMEOUT=200 step test-medium72 python3 -m pytest -q -m gpu tests/test_experts_gpu.py -k "blocks_around"
            STEP_TIMEOUT=120 step sanitizer-medium72 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
                -m gpu tests/test_experts_gpu.py -k "blocks_around and 72 and indexed"
            for w in bf16 mxfp4; do
                [ "${MEDIUM72_AB:-0}" = 1 ] || break
                kind=$([ $w = bf16 ] && echo bf16 || echo mxfp4_hopper4)
                sml=$(python3 -c "from padded_moe.kernels import gemm as kg; print(kg.TUNED[('$kind', 'small')].short())")
                STEP_TIMEOUT=150 step "m72-$w" python3 benchmarks/bench_tiles_ab.py --preset dsv4-flash --weights $w \
                    --regime medium --tokens 3072,4096 --rounds 5 --out "$OUT/m72-$w" --candidates "$sml@64"
            done ;;
        mx-layer)  # FusedMoE holding MXFP4 parameters only: preset layer vs the float64 reference, compiled MXFP4
            # layers (fullgraph / reduce-overhead / dynamic), the device memory one GPT-OSS-120B-width layer takes
            STEP_TIMEOUT=200 step test-mx-layer python3 -m pytest -q -m gpu tests/test_experts_gpu.py -k "preset_layers and gpt-oss"
            STEP_TIMEOUT=300 step test-compile-mx python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k "mxfp4"
            step mx-layer-memory python3 -c "
import time, torch
from padded_moe.layer import FusedMoE
t0 = time.time()
layer = FusedMoE.from_preset('gpt-oss-120b', device='cuda', dtype=torch.bfloat16)
torch.cuda.synchronize(); t1 = time.time()
q13, q2 = layer.expert_weights()
nb = lambda t: t.numel() * t.element_size()
canon = sum(nb(t) for q in (q13, q2) for t in (q.blocks, q.scales))
prep = sum(nb(t) for q in (q13, q2) for t in (q.hopper.blocks, q.hopper.scales))
bf16 = 2 * (q13.shape[0] * q13.shape[1] * q13.shape[2] + q2.shape[0] * q2.shape[1] * q2.shape[2])
print(f'construction {t1 - t0:.1f} s; allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB; canonical '
      f'{canon / 2**30:.2f} + prepared {prep / 2**30:.2f} GiB; bf16 experts would be {bf16 / 2**30:.2f} GiB')
x = torch.randn(64, layer.hidden_size, device='cuda', dtype=torch.bfloat16)
with torch.no_grad():
    print('forward finite:', bool(torch.isfinite(layer(x)).all()))
" ;;
        mx-sweep-calls)  # prepared-MXFP4 tile candidates on whole calls (alternating graph replays) where
            # the peers' 1024 / 8192-token columns land (decode / medium regimes), then the GEMM table of the docs
            for spec in "gpt-oss-120b medium 8192" "dsv4-flash medium 8192" "gpt-oss-120b decode 1024"; do
                set -- $spec
                STEP_TIMEOUT=150 step "sweep-$1-$2" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                    --regime "$2" --tokens "$3" --candidates sweep --rounds 3 --out "$OUT/sweep-$1-$2"
            done
            STEP_TIMEOUT=200 step bench-mx-hopper python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss,dsv4-flash \
                --rows 1,32,128,512,2048 --no-sweep --out "$OUT/bench-mx-hopper" ;;
        mx-small-ab)  # prepared-MXFP4 sweep winners on whole calls where the peers' 128 / 1024-token columns land
            ab() { STEP_TIMEOUT=150 step "ab-$1-$2-$3" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                --regime "$2" --tokens "$3" --candidates "$4" --fuse-activation "${5:-table}" --rounds 5 --out "$OUT/ab-$1-$2-$3"; }
            ab gpt-oss-120b small 1024 BM64_BN256_BK128_G4_w8_s3_hop_ptx,BM64_BN128_BK128_G4_w4_s4_hop_ptx,BM64_BN256_BK64_G4_w8_s3_hop_ptx both
            ab gpt-oss-120b decode 128 BM32_BN128_BK128_G1_w4_s4_hop_ptx,BM16_BN128_BK256_G1_w4_s3_hop_ptx
            ab dsv4-flash decode 1024 BM32_BN128_BK128_G1_w4_s4_hop_ptx,BM16_BN128_BK256_G1_w4_s3_hop_ptx ;;
        mx-decode-ab)  # the decode entry's BK 128 / 4-stage twin on whole calls at every decode-regime column of the peers
            for spec in "gpt-oss-120b 16" "gpt-oss-120b 128" "dsv4-flash 16" "dsv4-flash 128" "dsv4-flash 1024"; do
                set -- $spec
                STEP_TIMEOUT=100 step "ab-$1-$2" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                    --regime decode --tokens "$2" --candidates BM32_BN128_BK128_G1_w4_s4_hop_ptx --rounds 5 --out "$OUT/ab-$1-$2"
            done ;;
        mx-planes-gemm)  # both prepared arrangements per GEMM (each with its own weights and table tile), the
            # warning once per device on the GPU, and Nsight Compute on the small- and medium-regime GEMMs
            # (occupancy, issue rate, what the warps wait on)
            STEP_TIMEOUT=200 step gemm-gptoss python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss \
                --rows 4,16,64,256,1024 --no-sweep --out "$OUT/gemm-gptoss"
            STEP_TIMEOUT=200 step gemm-dsv4 python3 benchmarks/bench_gemm.py --mxfp4-hopper --models dsv4-flash \
                --rows 8,64,192,1024 --no-sweep --out "$OUT/gemm-dsv4"
            step warn-once python3 -W default -c "
import warnings, torch
from padded_moe import Mxfp4NotPreparedWarning
from padded_moe.gemm import expert_gemm
from padded_moe.layouts import GemmLayout, build_layout
from padded_moe.mxfp4 import quantize_mxfp4
q = quantize_mxfp4(torch.randn(4, 256, 128, device='cuda', dtype=torch.bfloat16))
ids = (torch.arange(64, device='cuda', dtype=torch.int32) // 16).view(-1, 1)
meta = build_layout(GemmLayout.GROUPED_CONTIGUOUS, ids, 4)
a = torch.randn(64, 128, device='cuda', dtype=torch.bfloat16)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter('default')
    for _ in range(3):
        with warnings.catch_warnings():  # a filter change, as torch and Triton make
            pass
        expert_gemm(a, q, meta)
n = sum(issubclass(w.category, Mxfp4NotPreparedWarning) for w in seen)
print('warnings', n); assert n == 1, n"
            for rows in 32 256; do
                STEP_TIMEOUT=150 step "ncu-mx-$rows" ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
                    --section SchedulerStats --section LaunchStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
                    -k "regex:_expert_gemm_mx_hopper" --launch-skip 2 --launch-count 1 python3 scripts/ncu_small.py mx "$rows"
            done ;;
        pdl-probe)  # programmatic dependent launch between two decode-sized GEMVs, eager and in a captured graph
            STEP_TIMEOUT=150 step pdl-probe python3 scripts/pdl_probe.py --out "$OUT/pdl.json" ;;
        mx-planes)  # the 2-plane arrangement against 4 planes now that neither kernel's wgmmas are serialized:
            # whole calls (same weights, each arrangement with its table entry), then the 2-plane sweep on INDEXED
            for spec in "gpt-oss-120b small 1024" "gpt-oss-120b medium 8192" "dsv4-flash decode 1024" "dsv4-flash medium 8192"; do
                set -- $spec
                STEP_TIMEOUT=100 step "planes-$1-$3" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights mxfp4 \
                    --regime "$2" --tokens "$3" --candidates "$(python3 -c "from padded_moe.kernels import gemm as kg; print(kg.TUNED[('mxfp4_hopper4', '$2')].short())")" \
                    --planes both --rounds 5 --out "$OUT/planes-$1-$3"
            done
            STEP_TIMEOUT=300 step sweep-mx2 python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss,dsv4-flash \
                --rows 64,256,1024 --sweep-planes 2 --out "$OUT/sweep-mx2" ;;
        persistent-probe)  # where the probe's persistent matmul gained: stages and descriptors apart
            STEP_TIMEOUT=300 step ws-probe python3 scripts/ws_probe.py --timeout 45 --only host_desc_s3,device_desc_s3,persistent_host_desc,persistent_device_desc_s4 ;;
        decode-mx-dot)  # MXFP4 decode GEMM1 as an MMA (decode.MX_W13 = "dot"): its GPU tests against the oracle and the
            # layout path, sanitizer, then whole decode calls with GEMM1 as a GEMV / as an MMA (three K steps), alternating
            STEP_TIMEOUT=200 step test-decode-mx-dot python3 -m pytest -q -n 2 -m gpu tests/test_decode_gpu.py -k "mxfp4"
            STEP_TIMEOUT=150 step sanitizer-decode-mx-dot compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m \
                pytest -q -m gpu tests/test_decode_gpu.py -k "sanitizer and dot"
            STEP_TIMEOUT=200 step ab-decode-mx-dot python3 benchmarks/bench_decode.py --weights mxfp4 --ab mxw13 \
                --presets gpt-oss-120b,dsv4-flash --out "$OUT/ab-decode-mx-dot" ;;
        decode-mx-auto)  # the one-token MMA as the MXFP4 default: every decode GPU test, launch plans, the compiled MXFP4
            # call, the MXFP4 experts suite, then the cold-L2 probe on both MXFP4 models (per kernel)
            STEP_TIMEOUT=240 step test-decode-all python3 -m pytest -q -n 2 -m gpu tests/test_decode_gpu.py \
                tests/test_launch_plan_gpu.py
            STEP_TIMEOUT=200 step test-mx-compile python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k mxfp4
            STEP_TIMEOUT=200 step test-mx-experts python3 -m pytest -q -n 2 -m gpu tests/test_experts_gpu.py -k "mxfp4 or gpt"
            STEP_TIMEOUT=150 step decode-cold-mx python3 scripts/decode_cold_probe.py --no-pure-reads \
                --cases gpt-oss-120b:mxfp4,dsv4-flash:mxfp4 --out "$OUT/decode-cold-mx.json" ;;
        decode-words)  # MXFP4 decode kernels reading 32-bit words (canonical or prepared): tests and launch plans, sanitizer, timing of each MX_STEP
            step test-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py tests/test_launch_plan_gpu.py
            step sanitizer-decode compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k sanitizer
            for mx_step in bytes words prepared; do
                step "bench-decode-mx-$mx_step" python3 benchmarks/bench_decode.py --weights mxfp4 --mx-step "$mx_step" \
                    --presets gpt-oss-120b,dsv4-flash --out "$OUT/bench-decode-mx-$mx_step"
            done ;;
        owed)  # what the last CPU-only changes still need on a GPU: layouts, prepared-MXFP4 table + big tiles, the plug-in
            step test-layouts python3 -m pytest -q -m gpu tests/test_layouts_gpu.py
            step sanitizer-layouts compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_layouts_gpu.py -k "sanitizer or (cuda_matches and 3-6-256)"
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k hopper
            step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            step bench-mx-planes python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss,dsv4-flash \
                --rows 1,32,512 --no-sweep --out "$OUT/bench-mx-planes"
            step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py
            step test-plans python3 -m pytest -q -x -m gpu tests/test_launch_plan_gpu.py
            step test-no-sync python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k never_syncs ;;
        decode)  # the decode path: GPU tests, sanitizer, no-sync and plans, decode vs layout path + tile sweep
            step test-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py
            step sanitizer-decode compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k sanitizer
            step test-experts python3 -m pytest -q -m gpu tests/test_experts_gpu.py tests/test_launch_plan_gpu.py
            step test-no-sync python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k never_syncs
            STEP_TIMEOUT=300 step bench-decode python3 benchmarks/bench_decode.py --sweep --out "$OUT/bench-decode" ;;
        decode-mx)  # MXFP4 on the decode path: GPU tests, sanitizer, decode vs layout + tile sweep, peers at T=1
            step test-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py
            step sanitizer-decode compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k sanitizer
            step bench-decode-mx python3 benchmarks/bench_decode.py --weights mxfp4 --presets gpt-oss-120b,dsv4-flash \
                --sweep --out "$OUT/bench-decode-mx"
            if [ -d .peers ]; then
                STEP_TIMEOUT=200 step peers env OUT="$OUT/peers" BUDGET_S=100 TIMEOUT_S=150 bash .peers/run.sh \
                    --tokens 1 --cases gptoss,dsv4mx
            fi ;;
        decode-mx-final)  # the final MXFP4 decode path: its tests and sanitizer, the GPU suites that call it (experts, plans, HF, no-sync)
            step test-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py
            step sanitizer-decode compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k sanitizer
            step test-experts python3 -m pytest -q -m gpu tests/test_experts_gpu.py tests/test_launch_plan_gpu.py
            step test-no-sync python3 -m pytest -q -m gpu tests/test_compile_gpu.py -k never_syncs
            step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py ;;
        decode-e2e)  # the decode path after a change: tests, sanitizer, decode vs layout, HF end to end, peers at T=1
            step test-decode python3 -m pytest -q -m gpu tests/test_decode_gpu.py
            step sanitizer-decode compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
                tests/test_decode_gpu.py -k sanitizer
            step bench-decode python3 benchmarks/bench_decode.py --out "$OUT/bench-decode"
            step profile-qwen3 python3 benchmarks/profile_layer.py --graph --preset qwen3-30b-a3b --tokens 1
            STEP_TIMEOUT=200 step bench-hf python3 benchmarks/bench_hf.py --iters 5 --out "$OUT/bench-hf"
            if [ -d .peers ]; then
                STEP_TIMEOUT=200 step peers env OUT="$OUT/peers" BUDGET_S=100 TIMEOUT_S=150 bash .peers/run.sh \
                    --tokens 1 --cases dsv4,qwen3,mixtral
            fi ;;
        gemm-models)  # bf16 expert GEMMs on the Qwen3-MoE, Mixtral and GPT-OSS shapes (all their experts) + the sweep
            STEP_TIMEOUT=500 step bench-gemm-models python3 benchmarks/bench_gemm.py --presets qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b \
                --no-masked --out "$OUT/bench-gemm-models" ;;
        rs)  # the RS kernel in the library (prepared MXFP4 on backend "cuda", grouped.launch_rs): the native GEMM's
            # CPU and GPU tests (float64 references, NaN padding, graph replay, auto's choice, the gated epilogue against
            # the two steps, 256- and 320-row chunks), memcheck of the small RS calls, then whole calls (bench_native_gemm:
            # INDEXED Triton, auto, grouped Triton, grouped RS, grouped RS with its gated epilogue in both chunk sizes)
            # on the MXFP4 presets at RS_TOKENS
            STEP_TIMEOUT=300 step test-rs python3 -m pytest -q tests/test_cuda_backend.py tests/test_native.py \
                tests/test_native_grouped_gpu.py
            STEP_TIMEOUT=150 step sanitizer-rs compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
                -m gpu tests/test_native_grouped_gpu.py -k "rs_sanitizer"
            STEP_TIMEOUT=${RS_BENCH_S:-300} step bench-rs python3 benchmarks/bench_native_gemm.py --calls-only \
                --presets gpt-oss-120b:mxfp4,dsv4-flash:mxfp4 --tokens "${RS_TOKENS:-2048,3072,4096,6144,8192}" \
                --variants "auto;grouped, Triton;grouped, cuda;grouped, cuda, fused, chunks256;grouped, cuda, fused, chunks320" \
                --out "$OUT/bench-rs" ;;
        mx-rs)  # the RS kernel's probe (scripts/mx_rs: the library's RS tile body under one CTA per tile, tiles from
            # blockIdx): build, a small case first (a hang or a wrong mapping stops there), then outputs against float64
            # and times against the Triton kernel and the library's RS kernel (masked and contiguous, both walk
            # orders), routed counts at MXRS_TOKENS and equal counts at MXRS_ROWS
            STEP_TIMEOUT=120 step build-mx-rs bash scripts/mx_rs/build.sh
            STEP_TIMEOUT=90 step mx-rs-small python3 scripts/mx_rs_probe.py --presets gpt-oss-120b --stage w2 \
                --tokens 64 --stages 4
            grep -q "mx-rs-small rc=0" "$summary" || continue
            STEP_TIMEOUT=${MXRS_S:-400} step mx-rs python3 scripts/mx_rs_probe.py --tokens "${MXRS_TOKENS:-1024,8192}" \
                --rows "${MXRS_ROWS:-256,512}" ;;
        evict)  # loads marked L2 evict-first against the dirty lines do_bench's memset flush leaves in L2: pure
            # streaming reads after the memset and after a read-only flush
            STEP_TIMEOUT=420 step evict-probe python3 scripts/evict_probe.py --out "$OUT/bench/evict.json" ;;
        power)  # time and energy per call under sustained load, implementations in alternating 3-s windows
            # (scripts/power_probe.py; .peers carried): the 8192-token cases whose timings run at the power cap;
            # POWER_KERNELS=N: then each call's kernels, profiled N times on the hot card
            STEP_TIMEOUT=120 step build-native python3 -m padded_moe build-native
            STEP_TIMEOUT=300 step power-probe python3 scripts/power_probe.py --cases "${POWER_CASES:-dsv4,mixtral,qwen3}" \
                --tokens "${POWER_TOKENS:-8192}" --rounds "${POWER_ROUNDS:-3}" --impls "${POWER_IMPLS:-padded_moe,triton_kernels,vllm_triton}" \
                --kernels "${POWER_KERNELS:-0}" --out "$OUT/bench/power.json" ;;
        humming)  # humming-kernels (carried as a wheel in .whl) against our prepared MXFP4 kernel on its three
            # layouts: its GPU test (INDEXED with its own row block), then bench_gemm --mxfp4-hopper --humming on the
            # models of HUMMING_MODELS at HUMMING_ROWS rows per expert (its JIT: ~20 s per configuration here)
            STEP_TIMEOUT=240 step test-humming env HUMMING_CACHE_DIR=/tmp/humming-cache python3 -m pytest -q -m slow \
                -k humming tests/test_gemm_gpu.py
            [ "${HUMMING_BENCH:-1}" = 1 ] || continue
            STEP_TIMEOUT=${HUMMING_S:-500} step bench-humming env HUMMING_CACHE_DIR=/tmp/humming-cache \
                python3 benchmarks/bench_gemm.py --mxfp4-hopper --humming --no-sweep \
                --models "${HUMMING_MODELS:-gpt-oss}" --rows "${HUMMING_ROWS:-1,4,8,16,32,128,512}" \
                --out "$OUT/bench-humming" ;;
        masked-expected)  # the grouped layouts' tiles sized for the expected rows (expected_m of batched_experts and
            # fused_experts, the mean of a masked layout built from slots) and the walk over the tiles with rows
            # (kernels.gemm.grouped_walks): GPU tests of batched_experts at every expected_m, of the GEMMs on masked
            # layouts and of the walk, of a flat receive buffer with expected_m, memcheck of the hinted tiles and of
            # the walk (timings: layout-probe with PROBE_CAPACITY 16, buffers with room for many rows and a few of
            # them used, the expert-parallel decode case)
            STEP_TIMEOUT=360 step test-masked python3 -m pytest -q -m gpu tests/test_experts_gpu.py tests/test_gemm_gpu.py \
                -k "batched_experts_on_gpu or grouped_masked or masked_walk or flat_receive_buffer_with_expected_m"
            STEP_TIMEOUT=240 step sanitizer-masked compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
                -q -m gpu tests/test_experts_gpu.py tests/test_gemm_gpu.py -k "(batched_experts_on_gpu and (2-mxfp4 or \
                24-mxfp4 or 2-bf16 or 24-bf16)) or masked_walk_graph_replay or (flat_receive_buffer_with_expected_m and (3-mxfp4 or \
                None-mxfp4))" ;;
        layout-probe)  # each expert GEMM alone on the three layouts under routed counts (scripts/layout_tiles_probe.py):
            # outputs against INDEXED's (exit 1 past one bf16 rounding) and times, PROBE_PRESETS at PROBE_TOKENS, both
            # weight kinds unless PROBE_WEIGHTS names one
            for weights in ${PROBE_WEIGHTS:-mxfp4 bf16}; do
                STEP_TIMEOUT=${PROBE_S:-240} step "layout-probe-$weights" python3 scripts/layout_tiles_probe.py \
                    --presets "${PROBE_PRESETS:-gpt-oss-120b,dsv4-flash}" --tokens "${PROBE_TOKENS:-1024}" --weights "$weights" \
                    --capacity "${PROBE_CAPACITY:-4}"
            done ;;
        humming-calls)  # whole MXFP4 calls with humming's GEMMs on GROUPED_CONTIGUOUS against ours (auto and the
            # grouped Triton path), CALLS_CASES "PRESET:TOKENS,..." separated by spaces; with CALLS_SANITIZER=1 first
            # memcheck of the prepared kernel's tiles (the grouped layouts' 16-row decode tile included)
            if [ "${CALLS_SANITIZER:-1}" = 1 ]; then
                STEP_TIMEOUT=200 step sanitizer-hopper compute-sanitizer --tool memcheck --error-exitcode 9 \
                    python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k "hopper_small_sanitizer"
            fi
            for case in ${CALLS_CASES:-gpt-oss-120b:mxfp4:1024,8192 dsv4-flash:mxfp4:1024,8192}; do
                STEP_TIMEOUT=${CALLS_S:-300} step "calls-humming-${case%%:*}" env HUMMING_CACHE_DIR=/tmp/humming-cache \
                    python3 benchmarks/bench_native_gemm.py --calls-only --presets "${case%:*}" --tokens "${case##*:}" \
                    --rounds 5 --out "$OUT/calls-humming-${case%%:*}" --variants "auto;grouped, Triton;grouped, humming"
            done ;;
        hf)
            step test-hf python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py ;;
        hf-mxfp4)  # HF MXFP4 routes: GPT-OSS checkpoints loaded as MXFP4, DeepSeek-V4's FP4 FP8Experts (GPU tests,
            # memcheck of the loaded model's forward), ExpertMap.from_table in graph replays, then GPT-OSS-120B-width layers loaded as MXFP4 against the
            # same checkpoint dequantized (HF grouped_mm and our bf16): experts memory, prefill and eager decode
            STEP_TIMEOUT=150 step test-hf-mxfp4 python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py \
                -k "mxfp4 or fp4"
            STEP_TIMEOUT=120 step test-expert-map-table python3 -m pytest -q -m gpu tests/test_experts_gpu.py -k graph_capture
            STEP_TIMEOUT=200 step sanitizer-hf-mxfp4 compute-sanitizer --tool memcheck --error-exitcode 9 \
                python3 -m pytest -q -m gpu tests/test_transformers_parity_gpu.py -k "mxfp4_checkpoint"
            STEP_TIMEOUT=400 step bench-hf-mxfp4 python3 benchmarks/bench_hf_mxfp4.py --work /tmp/hf-mxfp4 \
                --out "$OUT/bench-hf-mxfp4" ;;
        hf-e2e)  # HF models end to end, padded_moe vs grouped_mm (issue 18's table); report written per model
            STEP_TIMEOUT=540 step bench-hf python3 benchmarks/bench_hf.py --out "$OUT/bench-hf" ;;
        ep)
            step test-ep-kernels python3 -m pytest -q -m gpu tests/test_ep_kernels.py
            step sanitizer-ep compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_ep_kernels.py -k cuda_equals
            step test-ep python3 -m pytest -q -rA -m gpu tests/test_distributed_gpu.py
            step bench-ep python3 benchmarks/bench_ep.py --profile --out "$OUT/bench"
            step bench-ep-single-call python3 benchmarks/bench_ep.py --no-layer --chain 1 --iters 40 --out "$OUT/bench-single" ;;
        ep-all)  # two GPUs: every EP test on every transport, the put stress test, the HF model, the benchmark
            STEP_TIMEOUT=150 step test-ep-put python3 -m pytest -x -q -rA -s tests/test_ep_put_gpu.py
            if grep -q " passed" "$OUT/test-ep-put.log"; then
                step test-ep python3 -m pytest -q -rA -m gpu tests/test_distributed_gpu.py tests/test_ep_engine.py tests/test_ep_kernels.py
                step test-hf-ep python3 -m pytest -q -rA -s tests/test_transformers_ep_gpu.py
                STEP_TIMEOUT=120 step sanitizer-ep-put compute-sanitizer --tool memcheck --target-processes all \
                    --report-api-errors no --error-exitcode 9 python3 -m pytest -x -q tests/test_ep_put_gpu.py -k "flat and uneven"
                step bench-ep-put python3 benchmarks/bench_ep.py --profile --transports nccl symm_mem \
                    --tokens 16 128 1024 4096 --out "$OUT/bench-put"
            fi ;;
        ep-timeline)  # kernel timeline of chained graph replays (gaps, overlap with NCCL)
            step ep-timeline python3 benchmarks/bench_ep.py --no-layer --timeline --tokens 16 1024 --iters 20 --out "$OUT/timeline" ;;
        ep-kernels)  # one GPU: sweep of the EP kernels' launch shapes
            step bench-ep-kernels python3 benchmarks/bench_ep_kernels.py --out "$OUT/bench" ;;
        compile)  # torch.compile of the layer on every preset (fullgraph, reduce-overhead, dynamic)
            step test-compile python3 -m pytest -q -x -m gpu tests/test_compile_gpu.py
            step bench-compile python3 benchmarks/bench_compile.py --out "$OUT/bench" ;;
        host)  # eager host overhead: per-call launches, allocations, syncs, Python profile
            step profile-host python3 benchmarks/profile_host.py ;;
        plans)  # eager launch plans: replay == full path, no sync; the compiled layer (tests, ratios); HF end to end
            step test-plans python3 -m pytest -q -x -m gpu tests/test_launch_plan_gpu.py
            STEP_TIMEOUT=400 step test-compile python3 -m pytest -q -m gpu tests/test_compile_gpu.py
            step bench-compile python3 benchmarks/bench_compile.py --out "$OUT/bench"
            step profile-host python3 benchmarks/profile_host.py --cases dsv4:1 qwen3:1 --layers qwen3-30b-a3b:16 ;;
        compile-host)  # the compiled layer's host cost: op registration + plans (tests, ratios, one profile)
            step test-plans python3 -m pytest -q -x -m gpu tests/test_launch_plan_gpu.py
            STEP_TIMEOUT=400 step test-compile python3 -m pytest -q -m gpu tests/test_compile_gpu.py tests/test_activation_gpu.py -k "compile or graph"
            step bench-compile python3 benchmarks/bench_compile.py --out "$OUT/bench"
            step profile-compile python3 benchmarks/bench_compile.py --profile --presets qwen3-30b-a3b --tokens 16 \
                --out "$OUT/bench-compile-profile" ;;
        plans-quick)  # a launch-plan change: replay == full path, compiled == eager (two presets), host cost
            step test-plans python3 -m pytest -q -x -m gpu tests/test_launch_plan_gpu.py
            step test-compile python3 -m pytest -q -x -m gpu tests/test_compile_gpu.py -k "matches_eager and fullgraph and (qwen3 or gpt)"
            step bench-compile python3 benchmarks/bench_compile.py --presets qwen3-30b-a3b --tokens 16 --out "$OUT/bench"
            step profile-host python3 benchmarks/profile_host.py --cases dsv4:1 qwen3:1 ;;
        mx-wide)  # prepared-MXFP4 kernel incl. the mx_wide candidates: exactness on the GPU, then the sweep
            step test-hopper python3 -m pytest -q -m gpu tests/test_gemm_gpu.py -k hopper
            STEP_TIMEOUT=400 step bench-mx-hopper python3 benchmarks/bench_gemm.py --mxfp4-hopper --models gpt-oss \
                --rows 1,8,32,128,512 --out "$OUT/bench-mx-hopper" ;;
        compile-stress)  # issue 19's stability criterion: every compiled case, 50 calls each, in 5 fresh processes
            for i in 1 2 3 4 5; do
                STEP_TIMEOUT=200 step "compile-process-$i" python3 -m pytest -q -x -m gpu tests/test_compile_gpu.py -k matches_eager
            done ;;
        compile-two)  # two GPUs: the compiled layer with expert parallelism (automatic and by-hand dispatch/combine)
            STEP_TIMEOUT=400 step test-compile-two env PADDED_MOE_SPAWN_TIMEOUT=200 python3 -m pytest -q -rA -m gpu \
                tests/test_distributed_gpu.py -k compiled_layer_two_gpus ;;
        compile-profile)  # where compiled calls spend time next to eager ones (kernels, host events)
            step profile-compile python3 benchmarks/bench_compile.py --profile --presets qwen3-30b-a3b dsv4-flash:bf16 \
                --tokens 16 1024 --out "$OUT/bench-compile" ;;
        wide-bf16)  # bf16 256-row tiles over 256-row INDEXED blocks (an expert's rows under one weight stream)
            # against the table's 128-row tile, whole calls, alternating rounds (issue 14, DeepSeek-V4 8192)
            w=BM256_BN128_BK64_G8_w8
            for run in "dsv4-flash 8192" "qwen3-30b-a3b 4096"; do
                set -- $run
                STEP_TIMEOUT=200 step "ab-wide-$1-$2" python3 benchmarks/bench_tiles_ab.py --preset "$1" --weights bf16 \
                    --regime medium --tokens "$2" --rounds 3 --out "/tmp/ab-wide-$1" \
                    --candidates "BM128_BN256_BK64_G16_w8_s4_tma_pers@256,${w}_s3_tma@256,${w}_s3_tma_pers@256,${w}_s4_tma_pers@256,${w}_s3_tma_pers_dyn@256"
            done ;;
        gpu-suite)  # every single-GPU test file in one pytest (4 workers share the GPU)
            STEP_TIMEOUT=540 step test-gpu-suite python3 -m pytest -q -n 4 -rf -m "gpu and not multigpu" tests ;;
        cpu-suite)
            step test-all-gpu python3 -m pytest -q -x tests ;;
        *) echo "unknown stage $stage" | tee -a "$summary" ;;
    esac
done
echo "=== summary"; cat "$summary"
