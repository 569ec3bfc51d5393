# tinyllm: `make lab` opens the course, `make test` runs every test. Both set up .venv first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The PyTorch release the course is tested with, installed before the package (whose own
# requirement is the open torch>=2.3). Pick another with e.g. `make lab TORCH=torch`.
TORCH  ?= torch==2.13.0
NBVAL  := --nbval-lax --nbval-current-env
# Jupyter refuses to run as root (containers often are) unless told to.
ROOT_OK := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test test-fast check bench gpu-check notebooks clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[notebooks,dev]"
	touch $(STAMP)

lab: $(STAMP)                     ## open the course in JupyterLab
	$(BIN)/jupyter lab $(ROOT_OK) notebooks/

test: $(STAMP)                    ## every test: package, exercises (solutions), notebooks, stub proof
	$(BIN)/python -m tinyllm.check --stubs-fail
	$(BIN)/python -m pytest tests notebooks $(NBVAL) -q -p no:cacheprovider

test-fast: $(STAMP)               ## the package and exercise tests only
	$(BIN)/python -m pytest tests -q

check: $(STAMP)                   ## check your exercise: make check EX=01
	$(BIN)/python -m tinyllm.check $(EX)

bench: $(STAMP)                   ## static against continuous batching on a long-tailed workload
	$(BIN)/python -m tinyllm bench --workload longtail --batch 16

gpu-check: $(STAMP)               ## on a GPU: the CUDA tests, then decode-step time eager against graphed
	$(BIN)/python -m pytest tests -m cuda -q -s -p no:cacheprovider
	$(BIN)/python -m tinyllm bench --decode-steps

notebooks: $(STAMP)               ## re-execute every notebook in place, outputs committed
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace notebooks/[0-9]*.ipynb

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
