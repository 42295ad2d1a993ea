# Two entry points (see README):  `make run`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# compile_check's PTX dumps, read by the tests (GEM_LP_COMPILE_DUMP) instead of building the kernels again
DUMP   := .build/compile

.PHONY: setup run test test-all sweep clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/test.txt requirements/cute.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/cpu.txt -r requirements/test.txt
	# the CuTe DSL stack, pinned, without its metadata's CUDA 12 libs (see requirements/cute.txt)
	$(BIN)/python -m pip install -q --no-deps -r requirements/cute.txt
	# torchrec's metadata pulls the CUDA build of fbgemm-gpu; fbgemm-gpu-cpu is installed above instead
	$(BIN)/python -m pip install -q --no-deps torchrec==1.8.0
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

# The main job: train the ranking model on its CPU default.
run: setup
	$(BIN)/python train.py

# Every CuTe kernel built for Hopper and Blackwell (no GPU needed; the two arches in parallel), then the test suite
# (Triton kernels run under TRITON_INTERPRET=1 on CPU machines). Tests marked `slow` run in `make test-all`.
test: setup
	rm -rf $(DUMP)
	$(BIN)/python -m gem_lp.compile_check --arch sm_90a --arch sm_100a --dump-dir $(DUMP)
	GEM_LP_COMPILE_DUMP=$(DUMP) $(BIN)/python -m pytest -q -n 2

test-all: setup
	rm -rf $(DUMP)
	$(BIN)/python -m gem_lp.compile_check --arch sm_90a --arch sm_100a --dump-dir $(DUMP)
	GEM_LP_COMPILE_DUMP=$(DUMP) $(BIN)/python -m pytest -q -n 2 --slow

sweep: setup
	$(BIN)/python train.py -m model=gem_bf16,gem_mxfp8

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .build
