#!/usr/bin/env bash
# On a GPU machine with no network, from the repository root (copied there with .gpu/ and .whl/):
#   bash .gpu/run.sh   (prepared by benchmarks/gpu/prepare_offline.sh)
# Installs the carried wheels into /tmp/site (gymnasium, pettingzoo, trl, datasets and what they need that the
# image lacks, and setuptools 84: the image's may predate the SPDX license string of pyproject.toml, which
# setuptools reads from 77 on; PYTHONPATH puts it first for the --no-build-isolation build) and the repo with
# its env packages (no dependencies, offline),
# prints the machine and the versions, runs the GPU lane (make test-gpu's tests), then the GRPO step benchmark on cuda with
# SmolLM2-135M-Instruct's shapes (random weights from .gpu/smollm2-135m) against TRL, LoRA and full.
# Everything is tee'd to $OUT/run.log; pytest.txt, bench.txt and bench.json beside it.
# Dry runs elsewhere: PY (interpreter), NO_WHEELS=1 (skip the wheels), BENCH_DEVICE, BENCH_ARGS, TEST_DEVICE.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
BENCH_DEVICE="${BENCH_DEVICE:-cuda}"
BENCH_ARGS="${BENCH_ARGS:---steps 5}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false TINKERGYM_CACHE=/tmp/tinkergym-cache
[ -n "${TEST_DEVICE:-}" ] && export TINKERGYM_TEST_DEVICE="$TEST_DEVICE"

main() {
    echo "== $(date -u +%FT%TZ) $(hostname) $(pwd)"
    nvidia-smi || echo "(no nvidia-smi)"
    nproc; free -g | head -2
    "$PY" --version

    echo "== wheels (${SECONDS}s)"
    if [ -z "${NO_WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH=/tmp/site || echo "!! wheel install failed"
    fi

    echo "== repo and env packages (${SECONDS}s)"
    if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index -q . ./env_packages/bandit ./env_packages/gomoku ./env_packages/math; then
        echo "!! install into the interpreter's site-packages failed; trying --target /tmp/site"
        "$PY" -m pip install --no-deps --no-build-isolation --no-index -q --upgrade --target /tmp/site . ./env_packages/bandit ./env_packages/gomoku ./env_packages/math
        export PYTHONPATH=/tmp/site
    fi

    # -P: the repository root (the working directory) is not put on sys.path, so `tinkergym` is the installed
    # package, not the source folder tinkergym/ (whose subpackages live elsewhere in the tree).
    echo "== versions (${SECONDS}s)"
    "$PY" -P - <<'EOF'
import importlib.metadata as md
import importlib.util
names = ["torch", "transformers", "peft", "accelerate", "trl", "datasets", "pyarrow", "pandas", "fsspec", "huggingface_hub",
         "tokenizers", "safetensors", "numpy", "gymnasium", "pettingzoo", "dill", "multiprocess", "tensorboardX", "protobuf",
         "pytest", "tinkergym", "tinkergym-bandit", "tinkergym-gomoku", "tinkergym-math"]
for name in names:
    try:
        print(f"{name:18} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name:18} not installed")
print(f"{'flash_attn':18} {'present' if importlib.util.find_spec('flash_attn') else 'absent'}")
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF

    echo "== install check (${SECONDS}s)"
    "$PY" -P -c "import tinkergym, trl, datasets; env = tinkergym.make('tinker/Bandit-v0'); obs, info = env.reset(seed=0); print(tinkergym.__file__); print(obs.splitlines()[0], '| reward of red:', env.step('red')[1])"

    echo "== the GPU lane: make test-gpu's tests (${SECONDS}s)"
    # make print-gpu-tests: -m gpu and the folders and modules that apply the marker.
    # shellcheck disable=SC2046
    TINKERGYM_GPU_FIGURES="$OUT/gpu_memory.jsonl" timeout 420 "$PY" -P -m pytest $(make -s -f Makefile print-gpu-tests 2>/dev/null || echo -m gpu tests/gpu) \
        -q -rsP -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"
    echo "pytest exit: ${PIPESTATUS[0]}"

    echo "== GRPO step benchmark, $BENCH_DEVICE, random SmolLM2-135M weights, $BENCH_ARGS (${SECONDS}s)"
    # shellcheck disable=SC2086
    timeout 360 "$PY" benchmarks/grpo_step.py --device "$BENCH_DEVICE" --model .gpu/smollm2-135m $BENCH_ARGS 2>&1 | tee "$OUT/bench.txt"
    echo "benchmark exit: ${PIPESTATUS[0]}"
    grep '^{' "$OUT/bench.txt" | tail -1 > "$OUT/bench.json"

    # With time to spare: TRL with its own default, gradient checkpointing on (what the first run turned off).
    if [ "$SECONDS" -lt 330 ] && [ -z "${NO_EXTRA:-}" ]; then
        echo "== TRL with gradient checkpointing (its default), $BENCH_DEVICE, --steps 3 (${SECONDS}s)"
        timeout $((450 - SECONDS)) "$PY" benchmarks/grpo_step.py --device "$BENCH_DEVICE" --model .gpu/smollm2-135m --only trl \
            --trl-gradient-checkpointing --steps 3 2>&1 | grep -v '^{' | tee "$OUT/bench_trl_gc.txt"
    fi
    echo "== done in ${SECONDS}s"
}

main 2>&1 | tee "$OUT/run.log"
