#!/usr/bin/env bash
# The 8B target rows of the fp8 and bf16 issues, vLLM 0.25 or vt, through the peer runner
# (../shared/peer/run_peer.sh, which the GPU machine cannot see: copy it with its extra/ and
# wordlevel_tok.py into .peer/runner and carry that folder, with .whl/; the vLLM bundle is staged in
# /tmp/vb as ../shared/peer/README.md says). Run on the GPU machine from the checkout's root:
#   E=vllm|vt SET=fp8|bf16 [KV=fp8] [ROWS="name:in:out:prompts:conc[:prefix] ..."] [VTX="..."] bash bench/serving/peer_rows.sh
# fp8: both engines with --quantization fp8 (KV=fp8 adds --kv-cache-dtype fp8), vt at vLLM's
# 8192-token budget; bf16: no quantization, the 2048-token shared-prefix row added. A sixth ROWS
# field is the row's --random-prefix-len (runner copy made here: .peer/runner/run_peer_rows.sh).
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
R=.peer/runner
test -f $R/run_peer.sh || { echo "no $R/run_peer.sh: copy ../shared/peer's runner there and carry it"; exit 2; }
sed -e 's/--disable-tqdm ${BENCH_ARGS:-}/--disable-tqdm ${7:+--random-prefix-len $7} ${BENCH_ARGS:-}/' \
    -e 's/IFS=: read name in out np c <<< "$w"/IFS=: read name in out np c pre <<< "$w"/' \
    -e 's/vbench $port "${e}_${P}_$name" $in $out $np $c$/vbench $port "${e}_${P}_$name" $in $out $np $c $pre/' \
    $R/run_peer.sh > $R/run_peer_rows.sh
grep -q 'random-prefix-len $7' $R/run_peer_rows.sh || { echo "the runner changed: prefix rows not supported"; exit 2; }
base="long:1024:128:500:256 ctx8k:8000:64:32:8 short:128:128:1024:256 lo:128:1024:512:256 one:128:256:8:1"
kv=""; [ "${KV:-}" = fp8 ] && kv="--kv-cache-dtype fp8"
nvidia-smi -L | tee -a $OUT/summary.log
case "${SET:?SET=fp8|bf16}" in
  fp8) PRESET=8b ENGINES=${E:?E=vllm|vt} VLLM_ARGS="--quantization fp8 $kv" \
         VT_ARGS="--quantization fp8 --max-num-batched-tokens 8192 $kv ${VTX:-}" WORK="${ROWS:-$base}" \
         bash $R/run_peer_rows.sh ;;
  bf16) PRESET=8b ENGINES=${E:?E=vllm|vt} VLLM_ARGS="$kv" VT_ARGS="--max-num-batched-tokens 8192 $kv ${VTX:-}" \
          WORK="${ROWS:-$base prefix:128:128:1024:256:2048}" bash $R/run_peer_rows.sh ;;
  *) echo "SET=fp8|bf16"; exit 2 ;;
esac
grep -E "up after|Output token|Failed|Mean TTFT|Mean TPOT" $OUT/summary.log
