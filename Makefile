# remat: install, test, demo, bench.  `make install && make demo` on a fresh Python 3.11 machine.
PYTHON ?= python
DEMO   ?= out/demo
# solvers the demo sweeps with (see `remat solvers`)
DEMO_SOLVERS ?= ilp,chen-greedy,checkpoint-all

.PHONY: install test notebooks demo bench clean

# torch first, pinned to the CPU wheel on local disk: a bare `torch` requirement resolved on its
# own would download a multi-GB CUDA build (the project itself asks only for torch>=2.4).
install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'

test:
	$(PYTHON) -m pytest -q

# execute notebooks/*.ipynb headless with nbclient (also part of `make test`); outputs are not
# written back. A notebook whose metadata `remat.requires` names a missing API is skipped.
notebooks:
	$(PYTHON) -m pytest -q -rs -m notebooks tests/test_viz.py

# A 32-layer chain (65 nodes, abstract units): plan it with the ILP at 0.4x of the
# checkpoint-all peak, re-simulate the plan, then sweep a few budgets with a few solvers.
# Under ~2 minutes on 2 cores (time limits below).
demo:
	mkdir -p $(DEMO)
	$(PYTHON) -m remat.cli generate chain --layers 32 -o $(DEMO)/chain32.json
	$(PYTHON) -m remat.cli plan $(DEMO)/chain32.json --budget 0.4x --solver ilp --time-limit 40 -o $(DEMO)/plan.json
	$(PYTHON) -m remat.cli simulate $(DEMO)/plan.json
	$(PYTHON) -m remat.cli plan $(DEMO)/chain32.json --budget 0.4x --solver ilp --no-swap --time-limit 20 -o $(DEMO)/plan_noswap.json
	$(PYTHON) -m remat.cli sweep $(DEMO)/chain32.json --budgets 0.3x:1.0x:3 --solvers $(DEMO_SOLVERS) --no-swap --time-limit 10 -o $(DEMO)/sweep.csv
	@echo "demo files in $(DEMO)/"

bench:
	$(PYTHON) benchmarks/solve_scaling.py

clean:
	rm -rf out build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
