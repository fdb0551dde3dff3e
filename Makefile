# remat: install, test, demo, bench.  `make install && make demo` on a fresh Python 3.11 machine.
PYTHON ?= python
DEMO   ?= out/demo
# solvers demo-chain sweeps with (see `remat solvers`)
DEMO_SOLVERS ?= ilp,chen-greedy,checkpoint-all

.PHONY: install test notebooks demo demo-chain bench clean

# torch first, pinned to the CPU wheel on local disk: a bare `torch` requirement resolved on its
# own would download a multi-GB CUDA build (the project itself asks only for torch>=2.4).
install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev,models,vision]'

test:
	$(PYTHON) -m pytest -q

# execute notebooks/*.ipynb headless with nbclient (also part of `make test`); outputs are not
# written back. A notebook whose metadata `remat.requires` names a missing API is skipped.
notebooks:
	$(PYTHON) -m pytest -q -rs -m notebooks tests/test_viz.py

# The main job on a real model: GPT-2 (the zoo's small one: 2 layers, width 64) at batch 16 and
# sequence 256, where activations are nearly all of the step; traced at module depth 3, planned
# by the ILP at half the peak of keeping everything (no swap: on a CPU the host is the same RAM),
# trained three steps with the plan and three plain; then a picture of the plan.  About half a
# minute on 2 cores.
demo:
	mkdir -p $(DEMO)
	$(PYTHON) -m remat.cli run gpt2 --batch 16 --input-shape 256 --granularity module --depth 3 --budget 0.5x --no-swap \
	  --time-limit 30 --steps 3 --no-progress -o $(DEMO)/plan.json
	$(PYTHON) -m remat.cli show $(DEMO)/plan.json -o $(DEMO)/plan.png
	@echo "demo files in $(DEMO)/: plan.json, plan.png"

# The planner alone on a synthetic 32-layer chain (65 nodes, abstract units): plan it with the
# ILP at 0.4x of the checkpoint-all peak, re-simulate the plan, sweep a few budgets and solvers.
demo-chain:
	mkdir -p $(DEMO)
	$(PYTHON) -m remat.cli generate chain --layers 32 -o $(DEMO)/chain32.json
	$(PYTHON) -m remat.cli plan $(DEMO)/chain32.json --budget 0.4x --solver ilp --time-limit 40 -o $(DEMO)/chain_plan.json
	$(PYTHON) -m remat.cli simulate $(DEMO)/chain_plan.json
	$(PYTHON) -m remat.cli sweep $(DEMO)/chain32.json --budgets 0.3x:1.0x:3 --solvers $(DEMO_SOLVERS) --no-swap --time-limit 10 -o $(DEMO)/sweep.csv
	@echo "demo files in $(DEMO)/"

bench:
	$(PYTHON) benchmarks/solve_scaling.py

clean:
	rm -rf out build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
