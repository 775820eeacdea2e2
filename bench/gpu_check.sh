#!/usr/bin/env bash
# One device call: GPU tests, e2e serving on CUDA, decode-step benchmarks. Logs go to $OUT.
# Run from the checkout's root: bash bench/gpu_check.sh (STEPS="..." picks the steps; bench/README.md).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/vt-out}"; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi -L | tee "$OUT/device.log"
steps="${STEPS:-ops model e2e bench06 bench8}"
# transformers (generate and generate_batch), then vt at the same concurrency: $1 checkpoint, $2 log name
peer_pair() {
  timeout 300 python3 -m bench.serving.peer_transformers --model "$1" --batch 128 --json "$OUT/$2.json" 2>&1 \
    | grep -vE "Loading weights|WARNING" | tail -4 | tee "$OUT/$2.log"
  timeout 300 python3 -m vt bench --model "$1" --device cuda --no-progress --num-prompts 128 \
    --max-concurrency 128 --input-len 128 --output-len 64 --max-num-seqs 256 \
    --server-args='--max-model-len 2048' 2>&1 | grep -E "throughput|Duration" | tee -a "$OUT/$2.log"
}
# The environment of a decode-lever arm (levers, lever_rows, held_ab): base (the generic per-token
# quantizing kernels, VT_FP8_HELD_ROWS=0) or off (the defaults)
arm_env() {
  case $1 in base) echo "VT_FP8_HELD_ROWS=0" ;; *) echo "VT_LEVER_NONE=1" ;; esac
}
# A bench script in checkout $1 (this one: .), under a timeout of $2 s, as module $3 (serving.x); the rest
# are its arguments. Checkouts from before bench/ had folders keep their scripts as bench/x.py.
bench_in() {
  local tree=$1 secs=$2 module=$3
  shift 3
  if [ -f "$tree/bench/${module//.//}.py" ]; then
    (cd "$tree" && PYTHONPATH="$PWD:$PYTHONPATH" timeout "$secs" python3 -m "bench.$module" "$@")
  else
    (cd "$tree" && PYTHONPATH="$PWD:$PYTHONPATH" timeout "$secs" python3 "bench/${module#*.}.py" "$@")
  fi
}
# Where vLLM's FA3 module is importable from, into /tmp/fa3_site: the slim pack if carried
# (bench/kernels/fa3_pack.sh), else the peer's bundle staged in /tmp/vb, installed into /tmp/vsite
# (not marking /tmp/vb/.installed: the peer runner also installs vLLM's fp8 extras under that mark).
fa3_site() {
  if [ -f .peer/fa3pack/fa3slim.tar.xz ]; then
    test -d /tmp/fa3/vllm || { mkdir -p /tmp/fa3 && tar -xJf .peer/fa3pack/fa3slim.tar.xz -C /tmp/fa3; } || return 1
    echo /tmp/fa3 > /tmp/fa3_site
  else
    test -d /tmp/vsite/vllm || (cd /tmp/vb && SKIP_IMPORT_TEST=1 bash install.sh) || return 1
    echo /tmp/vsite > /tmp/fa3_site
  fi
}
for s in $steps; do
  echo "== $s $(date -u +%T)" | tee -a "$OUT/steps.log"
  case $s in
    ops) timeout 450 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_ops.py 2>&1 | tail -5 | tee "$OUT/ops.log" ;;
    model) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_model_cuda.py 2>&1 | tail -30 | tee "$OUT/model.log" ;;
    e2e) VT_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/e2e/test_openai_e2e.py 2>&1 | tail -30 | tee "$OUT/e2e.log" ;;
    kernels) timeout 150 python3 -m bench.kernels.kernel_bench 2>&1 | tail -20 | tee "$OUT/kernels.log" ;;
    gemm) timeout 200 python3 -m bench.probes.gemm_decode --preset 8b --json "$OUT/gemm8.json" 2>&1 | tail -40 \
      | tee "$OUT/gemm8.log" ;;
    lt) timeout 400 python3 -m bench.probes.lt_search --preset 8b --rows "${LT_ROWS:-64,128,256}" --seconds "${LT_SECONDS:-20}" --limit "${LT_LIMIT:-20000}" \
      --json "$OUT/lt8.json" 2>&1 | tail -60 | tee "$OUT/lt8.log" ;;
    layout) timeout 120 python3 -m bench.probes.gemm_layout --preset 8b --json "$OUT/layout8.json" 2>&1 | tail -12 \
      | tee "$OUT/layout8.log" ;;
    bench06) timeout 200 python3 -m bench.step.decode_step --preset 0.6b --batches 1,32,64,128,256 --context 512 \
      --modes "${MODES:-graph,eager}" 2>&1 | grep "^|" | tee "$OUT/decode06.log" ;;
    bench8) timeout 300 python3 -m bench.step.decode_step --preset 8b --batches 1,32,64,128,256 --context 512 --modes graph \
      2>&1 | grep "^|" | tee "$OUT/decode8.log" ;;
    serve06)
      timeout 120 python3 -m vt make-model /tmp/q06 --preset 0.6b > /tmp/make06.log 2>&1
      for c in ${CONC:-16 64 256}; do
        timeout 300 python3 -m vt bench --model /tmp/q06 --device cuda --compare-async --no-progress \
          --repeats "${REPEATS:-1}" --num-prompts $((c * 4 > 256 ? c * 4 : 256)) --max-concurrency $c \
          --input-len 128 --output-len 64 \
          --max-num-seqs 256 --server-args='--max-model-len 2048' --json "/tmp/serve06_c$c.json" 2>&1 \
          | tail -40 | sed "s/^/c=$c /" | tee -a "$OUT/serve06.log"
      done ;;
    serve8)
      # One server per arm, every concurrency against it: an 8B load is too slow to repeat per run.
      timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1 || tail -3 /tmp/make8.log
      for arm in async-scheduling no-async-scheduling; do
        python3 -m vt serve --model /tmp/q8 --device cuda --port 8123 --max-num-seqs 256 --max-model-len 2048 \
          --$arm > /tmp/serve8_$arm.log 2>&1 &
        pid=$!
        for i in $(seq 240); do grep -q "serving on" /tmp/serve8_$arm.log && break; sleep 1; done
        for c in ${CONC:-1 16 64 256}; do
          timeout 200 python3 -m vt bench --base-url http://127.0.0.1:8123 --model /tmp/q8 --no-progress \
            --num-prompts $((c * 2 > 32 ? c * 2 : 32)) --max-concurrency $c --input-len 128 --output-len 64 \
            --json /tmp/serve8_${arm}_c$c.json 2>&1 | grep -E "Output token throughput|Mean TTFT|Mean TPOT|Mean ITL|step time|idle" \
            | sed "s/^/8b $arm c=$c: /" | tee -a "$OUT/serve8.log"
        done
        kill -TERM $pid; wait $pid
      done ;;
    peer)
      test -d /tmp/q06 || timeout 120 python3 -m vt make-model /tmp/q06 --preset 0.6b > /tmp/make06.log 2>&1
      peer_pair /tmp/q06 peer ;;
    peer8)
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      peer_pair /tmp/q8 peer8 ;;
    host)  # the serving host's CPU cost per token (no GPU used): what bounds high-concurrency rows
      timeout 200 python3 -m bench.serving.host_overhead --repeats 3 2>&1 | tail -6 | tee "$OUT/host.log" ;;
    profile)
      # Every kernel of a step (depth 1) and the depth-2 device timeline; the 8B build takes ~1 min.
      for p in ${PRESETS:-0.6b 8b}; do
        timeout 240 python3 -m bench.step.step_profile --preset $p --batch "${BATCH:-64}" --context "${CONTEXT:-512}" \
          --prefill "${PREFILL:-0}" ${PROFILE_ARGS:-} 2>&1 | tail -60 \
          | sed "s/^/$p /" | tee -a "$OUT/profile.log"
      done ;;
    prefill)
      for p in 0.6b 8b; do
        timeout 200 python3 -m bench.step.prefill --preset $p --json "$OUT/prefill_$p.json" 2>&1 | tail -8 \
          | tee -a "$OUT/prefill.log"
      done ;;
    chunked)  # one prompt alone, chunked as served: 1k, 8k and 32k prompts at two chunk sizes
      for p in ${PRESETS:-0.6b 8b}; do
        timeout 300 python3 -m bench.step.prefill --preset $p --prompt-lens 1024,8192,32768 --chunks 2048,8192 \
          --repeats 3 --warmup 1 --json "$OUT/chunked_$p.json" 2>&1 | tail -9 | tee -a "$OUT/chunked.log"
      done ;;
    structured|structured_tests)  # the bitmask kernel and guided serving on CUDA
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_structured_cuda.py \
        tests/gpu/test_cuda_ops.py -k "bitmask or structured or json or regex or two_part" 2>&1 | tail -5 \
        | tee "$OUT/structured_tests.log"
      VT_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/e2e/test_structured_outputs.py \
        2>&1 | tail -10 | tee -a "$OUT/structured_tests.log" ;;&
    structured|structured_bench)  # the JSON-schema share table (0.6B shapes) and mask-fill times
      test -d /tmp/q06 || timeout 120 python3 -m vt make-model /tmp/q06 --preset 0.6b > /tmp/make06.log 2>&1
      timeout 590 python3 -m bench.serving.structured_outputs --model /tmp/q06 --device cuda --num-prompts 512 \
        --max-concurrency 128 --output-len 256 --shares "${SHARES:-0,25,100}" --server-args='--max-model-len 2048' --out "$OUT/structured" \
        2>&1 | tail -12 | tee "$OUT/structured.log"
      timeout 200 python3 -m bench.step.mask_fill --rows 32,128 --threads 1,4,8 2>&1 | tail -9 \
        | tee "$OUT/mask_fill.log" ;;
    tilings)  # prefill attention's tilings: on the device against numpy, kernel times, prompts as served
      # first the short diagnostic (a kernel that hangs costs 90 s here, not the suites' timeouts)
      timeout 90 python3 -m bench.kernels.attn_debug --tiling wg --tiling wgp --tiling wgv --tiling wgr 2>&1 | tail -40 \
        | tee "$OUT/tilings_tests.log"
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_ops.py -k "prefill_tilings or ragged" \
        2>&1 | tail -5 | tee -a "$OUT/tilings_tests.log"
      VT_PREFILL_TILING=${MODEL_TILING:-wg} timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
        tests/gpu/test_model_cuda.py 2>&1 | tail -5 | tee -a "$OUT/tilings_tests.log"
      timeout 200 python3 -m bench.kernels.attn_tilings --json "$OUT/tilings.json" --best "$OUT/best_tiling" 2>&1 | tail -40 \
        | tee "$OUT/tilings.log"
      for t in ${TILINGS:-wg wgp wgv wgr wg3 w8 m2}; do
        VT_PREFILL_TILING=$t timeout 200 python3 -m bench.step.prefill --preset 8b --prompt-lens 1024,8192,32768 \
          --chunks 2048 --repeats 3 --warmup 1 --json "$OUT/chunked_8b_$t.json" 2>&1 | tail -5 | sed "s/^/$t /" \
          | tee -a "$OUT/tilings.log"
      done ;;
    wgw)  # the producer-warpgroup prompt tilings (wgw, wgwp) against wgs: their GPU tests, kernel rates, then the
          # 8000/64 fp8 row served on each (SERVE_TILINGS; ~6 min in all)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_ops.py -k "prefill_tilings and wgw" \
        2>&1 | tail -4 | tee "$OUT/wgw.log"
      timeout 240 python3 -m bench.kernels.attn_tilings --tiling wgs --tiling wgw --tiling wgwp > "$OUT/wgw_time.log" 2>&1
      tail -30 "$OUT/wgw_time.log"
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for t in ${SERVE_TILINGS:-wgs wgw wgwp}; do
        VT_PREFILL_TILING=$t timeout 150 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-fp8-$t" \
          --rows targets --targets 8000/64 --out "/tmp/wgw_$t" --server-args="--max-num-seqs 256 --max-model-len 16384 \
          --quantization fp8 --max-num-batched-tokens 8192" 2>&1 | grep -v "^Loading" | tail -4 | sed "s/^/$t /" \
          | tee -a "$OUT/wgw.log"
      done ;;
    targets8)  # the peer's target rows, 8B, on $TILING, else the tiling the tilings step found best, else vt's default
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      t="${TILING:-$(cat "$OUT/best_tiling" 2>/dev/null)}"
      echo "prefill tiling: ${t:-default}" | tee "$OUT/targets8.log"
      VT_PREFILL_TILING=$t timeout 590 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-${t:-default}" --rows targets \
        --server-args="--max-num-seqs 256 --max-model-len 16384 ${VT_ARGS:-}" --budget "${BUDGET:-500}" --out "$OUT/t8" \
        2>&1 | grep -v "^Loading" | tee -a "$OUT/targets8.log" ;;
    fp8)  # the fp8 suite, then the 8B target rows with --quantization fp8 (FP8_ARMS="bf16 fp8 fp8kv8 bf16kv8":
          # bf16 weights, fp8 weights, each with the fp8 KV cache; TARGETS="1024/128,..." limits the rows)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_cuda.py 2>&1 | tail -15 | tee "$OUT/fp8_tests.log"
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for arm in ${FP8_ARMS:-fp8}; do
        extra=$(case "$arm" in fp8) echo "--quantization fp8" ;; fp8kv8) echo "--quantization fp8 --kv-cache-dtype fp8" ;;
                bf16kv8) echo "--kv-cache-dtype fp8" ;; esac)
        timeout 590 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-$arm" --rows targets \
          ${TARGETS:+--targets $TARGETS} --server-args="--max-num-seqs 256 --max-model-len 16384 $extra" \
          --budget "${BUDGET:-300}" --out "$OUT/t8_$arm" 2>&1 | grep -v "^Loading" | tee -a "$OUT/fp8_targets.log"
      done ;;
    kv8)  # the fp8 KV cache: its GPU tests (every code read back exactly, each kernel against numpy), the
          # fp8-KV engine test, then the decode-heavy rows with fp8 weights, fp8 KV and bf16 KV alternated
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_ops.py \
        -k "every_e4m3 or reads_fp8 or fp8_prompt or twins_codes or quantizes_what" 2>&1 | tail -5 | tee "$OUT/kv8_tests.log"
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_cuda.py -k kv8 2>&1 | tail -3 \
        | tee -a "$OUT/kv8_tests.log"
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for kv in fp8 auto; do
        timeout 300 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-fp8-kv-$kv" --rows targets \
          --targets "${KV8_ROWS:-128/1024,1024/128}" --budget "${BUDGET:-200}" --out "$OUT/kv8_$kv" \
          --server-args="--max-num-seqs 256 --max-model-len 16384 --quantization fp8 --kv-cache-dtype $kv" 2>&1 \
          | grep -E "^\| target|failed requests" | sed "s/^/kv $kv: /" | tee -a "$OUT/kv8_rows.log"
      done ;;
    fp8budget)  # the prefill-bound fp8 rows at token budgets 2048, 4096, 8192 (BUDGETS), fp8 KV on (KV)
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for b in ${BUDGETS:-2048 8192 4096}; do
        timeout 300 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-fp8-b$b" --rows targets \
          --targets "${BUDGET_ROWS:-1024/128,8000/64}" --budget "${BUDGET:-200}" --out "$OUT/fp8b_$b" \
          --server-args="--max-num-seqs 256 --max-model-len 16384 --quantization fp8 --kv-cache-dtype ${KV:-fp8} --max-num-batched-tokens $b" \
          2>&1 | grep -E "^\| target|failed requests" | sed "s/^/budget $b: /" | tee -a "$OUT/fp8budget.log"
      done ;;
    gemv)  # the decode GEMVs against cuBLAS(Lt), and the fp8 engine test at GEMV limits 16, 8 and 0
      timeout 150 python3 -m bench.probes.gemv --preset 8b --rows 1,8,16 --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log"
      for g in 16 8 0; do
        echo "VT_GEMV_MAX_TOKENS=$g" | tee -a "$OUT/gemv_engine.log"
        VT_GEMV_MAX_TOKENS=$g timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_cuda.py \
          -k engine_tokens 2>&1 | tail -4 | tee -a "$OUT/gemv_engine.log"
      done ;;
    levers)  # the fp8 decode lever, the held-row quantizing kernels (the default; base = the generic ones): its
             # GPU tests, then 8B fp8 decode steps per arm (LEVER_ARMS, LEVER_REPS rounds; ~2 min); lever_rows
             # serves the batch-1 and 8000/64 fp8 rows per arm (~2 min)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_cuda.py -k held_row 2>&1 | tail -4 \
        | tee "$OUT/levers.log"
      for rep in $(seq "${LEVER_REPS:-1}"); do
        for arm in ${LEVER_ARMS:-base off}; do
          env $(arm_env $arm) timeout 150 python3 -m bench.step.decode_step --preset 8b --max-model-len 16384 \
            --modes graph --bandwidth 3.0 --batches 1,8 --context 1024 --quantization fp8 2>&1 | grep "depth 2 |" \
            | sed "s/^/$arm /" | tee -a "$OUT/levers.log"
        done
      done ;;
    lever_rows)
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for arm in ${LEVER_ARMS:-off base}; do
        env $(arm_env $arm) timeout 150 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-fp8-$arm" \
          --rows targets --targets 128/256,8000/64 --out "/tmp/lever_$arm" \
          --server-args="--max-num-seqs 256 --max-model-len 16384 --quantization fp8 --max-num-batched-tokens 8192" \
          2>&1 | grep -E "^\| target|failed requests" | sed "s/^/$arm /" | tee -a "$OUT/levers.log"
      done ;;
    held_ab)  # fp8 step profiles per arm (HELD_ARMS: base = the generic per-token quantizing kernels, off =
              # the held-row ones), alternated: an 8000-token prompt step beside 7 decodes, decodes of 256 and 1
      for arm in ${HELD_ARMS:-base off base off}; do
        for shape in ${HELD_SHAPES:-7:4000:8000 256:1024:0 1:1024:0}; do
          IFS=: read -r nb ctx pf <<< "$shape"
          env $(arm_env $arm) timeout 150 python3 -m bench.step.step_profile --preset 8b --batch "$nb" --context "$ctx" \
            --prefill "$pf" --quantization fp8 --max-model-len 16384 2>&1 \
            | awk '/kernels per step/ {n = 14} n > 0 {print; n--; next} /quant|silu|qk_norm|^depth 2/' \
            | sed "s|^|$arm b=$nb p=$pf |" \
            | tee -a "$OUT/held_ab.log"
        done
      done ;;
    envelope) timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_envelope.py 2>&1 | tail -30 \
      | tee "$OUT/envelope.log" ;;
    matrix06)  # the serving matrix and the peer's target rows, 0.6B
      test -d /tmp/q06 || timeout 120 python3 -m vt make-model /tmp/q06 --preset 0.6b > /tmp/make06.log 2>&1
      timeout 590 python3 -m bench.serving.serving_matrix --model /tmp/q06 --label 0.6b --rows "${ROWS:-all}" \
        ${SHAPES:+--shapes $SHAPES} ${CONC:+--concurrency $CONC} --budget "${BUDGET:-480}" --out "$OUT/m06" \
        2>&1 | grep -v "^Loading" | tee "$OUT/matrix06.log" ;;
    matrix8)  # the same for 8B, and one 40,900-token prompt alone and beside 64 decoding requests
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      timeout 590 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label 8b --rows "${ROWS:-all}" \
        ${SHAPES:+--shapes $SHAPES} ${CONC:+--concurrency $CONC} --budget "${BUDGET:-420}" \
        --server-args="--max-num-seqs 256 --max-model-len 40960" --long "${LONG:-40900}" --out "$OUT/m8" \
        2>&1 | grep -v "^Loading" | tee "$OUT/matrix8.log" ;;
    trace8)  # the 8B target rows with a step trace, at each token budget: where their device time goes
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for b in ${BUDGETS:-2048 8192}; do
        for t in ${TRACE_ROWS:-1024/128 8000/64}; do
          f="/tmp/trace_${b}_${t/\//x}.jsonl"
          timeout 300 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-b$b" --rows targets --targets "$t" \
            --server-args="--max-num-seqs 256 --max-model-len 16384 --max-num-batched-tokens $b --step-trace $f ${TRACE_ARGS:-}" \
            --out "/tmp/tr_$b" 2>&1 | grep "^| target" | sed "s/^/b=$b /" | tee -a "$OUT/trace8.log"
          python3 -m bench.serving.step_trace_summary "$f" --budget "$b" | tee -a "$OUT/trace8.log"
        done
      done ;;
    structured_ab)  # the 0.6B structured load on this tree against another checkout ($AB_BASE), alternated, traced
      test -d /tmp/q06 || timeout 120 python3 -m vt make-model /tmp/q06 --preset 0.6b > /tmp/make06.log 2>&1
      for rep in ${REPS:-1 2}; do
        for tree in "${AB_BASE:?AB_BASE: a checkout to compare with}" .; do
          name=$([ "$tree" = . ] && echo this || echo base)
          for share in ${SHARES:-25 0}; do
            f="/tmp/tr_${name}_${share}_${rep}.jsonl"
            bench_in "$tree" 150 serving.structured_outputs \
              --model /tmp/q06 --device cuda --num-prompts 512 --max-concurrency 128 --output-len 256 --shares "$share" \
              --arms on --server-args="--max-model-len 2048 --step-trace $f" 2>&1 | grep -E "^\| *[0-9]+%" \
              | sed "s/^/$name r$rep /" | tee -a "$OUT/structured_ab.log"
            python3 -m bench.serving.step_trace_summary "$f" 2>&1 | grep "steps, device" | sed "s/^/$name s$share r$rep /" \
              | tee -a "$OUT/structured_ab.log"
          done
        done
      done ;;
    pacing)  # the 8B target rows with and without --prefill-pacing, alternated, each traced
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for rep in ${REPS:-1 2}; do
        for arm in off on; do
          f="/tmp/pace_${arm}_${rep}.jsonl"
          flag=$([ "$arm" = on ] && echo "--prefill-pacing")
          timeout 300 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-pacing-$arm" --rows targets \
            --targets "${PACE_ROWS:-8000/64,1024/128}" --out "/tmp/pace_$arm" \
            --server-args="--max-num-seqs 256 --max-model-len 16384 $flag ${SERVE_EXTRA:-} --step-trace $f" 2>&1 \
            | grep "^| target" | sed "s/^/$arm r$rep /" | tee -a "$OUT/pacing.log"
          python3 -m bench.serving.step_trace_summary "$f" --budget 2048 | sed "s/^/$arm r$rep /" | tee -a "$OUT/pacing.log"
        done
      done ;;
    overlap)  # a mixed step against its prompt and decode rows as two steps side by side (SM targets)
      # OVERLAP_ARGS: e.g. "--quantization fp8" (the fp8 GEMMs take the slot's SM target too)
      timeout 400 python3 -m bench.probes.overlap_probe --preset 8b --decodes "${DECODES:-227}" --context "${CONTEXT:-1088}" \
        --prompt "${PROMPT:-1820}" --sms "${SMS:-0,16,24,32,48}" ${OVERLAP_ARGS:-} 2>&1 | tail -30 | tee -a "$OUT/overlap.log" ;;
    split8)  # the 8B target rows with each mixed step split in two beside each other (VT_SPLIT_DECODE_SMS)
      test -d /tmp/q8 || timeout 200 python3 -m vt make-model /tmp/q8 --preset 8b > /tmp/make8.log 2>&1
      for k in ${SPLIT_SMS:-0 32}; do
        f="/tmp/split_$k.jsonl"
        VT_SPLIT_DECODE_SMS=$k timeout 300 python3 -m bench.serving.serving_matrix --model /tmp/q8 --label "8b-split$k" \
          --rows targets --targets "${SPLIT_ROWS:-1024/128,8000/64}" --out "/tmp/split_$k" \
          --server-args="--max-num-seqs 256 --max-model-len 16384 ${SERVE_EXTRA:-} --step-trace $f" 2>&1 \
          | grep "^| target" | sed "s/^/split=$k /" | tee -a "$OUT/split8.log"
        python3 -m bench.serving.step_trace_summary "$f" --budget 2048 | sed "s/^/split=$k /" | tee -a "$OUT/split8.log"
      done ;;
    fp8_ab)  # fp8 step profiles on this tree against another checkout ($AB_BASE), alternated: a prompt step
             # (8000 tokens beside 7 decodes: prompt attention, SiLU-mul and norm quantization) and decode steps;
             # ~45 s a profile, so one round by default (AB_REPS="1 2" for two)
      for rep in ${AB_REPS:-1}; do
        for tree in "${AB_BASE:?AB_BASE: a checkout to compare with}" .; do
          for shape in "7 4000 8000" "256 1024 0" "1 512 0"; do
            read -r nb ctx pf <<< "$shape"
            bench_in "$tree" 150 step.step_profile --preset 8b --batch "$nb" --context "$ctx" --prefill "$pf" \
              --quantization fp8 --kv-cache-dtype "${KV:-fp8}" 2>&1 | grep -A8 "kernels per step" \
              | sed "s|^|$([ "$tree" = . ] && echo this || echo base) b=$nb p=$pf r$rep |" | tee -a "$OUT/fp8_ab.log"
          done
        done
      done ;;
    kernels_ab)  # the element kernels' times on this tree against another checkout ($AB_BASE), alternated
      for rep in 1 2; do
        for tree in "${AB_BASE:?AB_BASE: a checkout to compare with}" .; do
          for b in ${AB_BATCHES:-2047 227}; do
            bench_in "$tree" 150 kernels.kernel_bench --batch "$b" 2>&1 \
              | grep -iE "silu|qk_norm|rms" | sed "s|^|$([ "$tree" = . ] && echo this || echo base) b=$b r$rep |" \
              | tee -a "$OUT/kernels_ab.log"
          done
        done
      done ;;
    attn_peer)  # prompt attention beside vLLM's FlashAttention-3 on the same paged cases: FA3 from the slim
                # pack (bench/kernels/fa3_pack.sh, carried as .peer/fa3pack), else from the peer's bundle
                # staged in /tmp/vb (../shared/peer/README.md), installed here if the peer runner has not
      fa3_site > "$OUT/fa3_site.log" 2>&1 || { echo "attn_peer: no FA3 (carry .peer/fa3pack or stage the bundle)"; continue; }
      (source /tmp/vb/vllm_env.sh 2>/dev/null; PYTHONPATH="$PWD:$(cat /tmp/fa3_site):/tmp/site" timeout 300 \
        python3 -m bench.kernels.attn_peer $(for t in ${PEER_TILINGS:-wgwp}; do echo --tiling $t; done) \
        --json "$OUT/attn_peer.json" 2>&1 | grep -vE "^(INFO|WARNING)" | tail -40 | tee "$OUT/attn_peer.log") ;;
    ncu_attn)  # one 8k prompt's attention under Nsight Compute, per tiling (fa3: vLLM's FlashAttention-3, found
               # as attn_peer finds it)
      n=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      for t in ${TILINGS:-wgv}; do
        kn=regex:attention_ pp=$PYTHONPATH
        if [ "$t" = fa3 ]; then
          fa3_site >> "$OUT/fa3_site.log" 2>&1 || { echo "ncu_attn: no FA3"; continue; }
          kn=regex:device_kernel pp="$PWD:$(cat /tmp/fa3_site):/tmp/site"
        fi
        (source /tmp/vb/vllm_env.sh 2>/dev/null; PYTHONPATH=$pp timeout 240 "$n" --kernel-name $kn --launch-skip 1 \
          --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
          --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
          --section InstructionStats python3 -m bench.kernels.attn_ncu --tiling $t --prompt 8192) \
          2>&1 | grep -vE "^==PROF==|^\s*$" | tail -150 | sed "s/^/$t /" | tee -a "$OUT/ncu.log"
      done ;;
    *) ;;
  esac
done
echo "== end $(date -u +%T)" | tee -a "$OUT/steps.log"
