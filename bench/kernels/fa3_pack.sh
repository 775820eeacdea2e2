#!/usr/bin/env bash
# vLLM's FlashAttention-3 extension alone, for bench/kernels/attn_peer.py and gpu_check's attn_peer and
# ncu_attn steps: the peer's vLLM 0.25 wheel (../shared/peer/bundle/make_bundle.sh .peer/vb) holds it as
# vllm/vllm_flash_attn/{__init__,flash_attn_interface}.py and _vllm_fa3_C.abi3.so (torch's extension,
# 146 MB); packed with an empty vllm/__init__.py it is 8 MB of xz, one carry instead of the bundle's
# three loads. Run from the checkout's root on the CPU machine; writes .peer/fa3pack/fa3slim.tar.xz.
set -eu
vb=${1:-.peer/vb}
whl=$(ls "$vb"/downloads/vllm-*.whl 2>/dev/null | head -1 || true)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -z "$whl" ]; then  # the bundle keeps the wheel in parts
  cat "$vb"/bundle/vllm-*.whl.part-* > "$tmp/vllm.whl"
  whl=$tmp/vllm.whl
fi
python3 - "$whl" "$tmp/pkg" <<'EOF'
import os, sys, zipfile
whl, dst = sys.argv[1], sys.argv[2]
names = ["vllm/vllm_flash_attn/__init__.py", "vllm/vllm_flash_attn/flash_attn_interface.py",
         "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]
with zipfile.ZipFile(whl) as z:
    for n in names:
        os.makedirs(os.path.join(dst, os.path.dirname(n)), exist_ok=True)
        with open(os.path.join(dst, n), "wb") as f:
            f.write(z.read(n))
with open(os.path.join(dst, "vllm/__init__.py"), "w") as f:
    f.write("# vLLM's FlashAttention-3 extension alone (bench/kernels/fa3_pack.sh)\n")
EOF
mkdir -p .peer/fa3pack
tar -cf - -C "$tmp/pkg" vllm | xz -9 -T0 > .peer/fa3pack/fa3slim.tar.xz
ls -la .peer/fa3pack/fa3slim.tar.xz
