# Fresh machine (Debian/Ubuntu x86_64, Python 3.10+, no ROS): `make demo`, `make test`.
.PHONY: setup test reliability demo demo-policy demo-speech bench bench-quick bench-peer bench-lerobot lint clean

setup:
	bash scripts/bootstrap.sh

test: setup
	bash scripts/run_tests.sh

# Soak, SIGKILL mid-write, full filesystem, racing clients and fuzz (minutes; not in `test`).
reliability: setup
	FLASHRT_RELIABILITY=1 bash scripts/run_tests.sh test/reliability -q

lint: setup
	bash scripts/run_tests.sh test/test_lint.py

demo: setup
	bash scripts/run_demo.sh

demo-policy: setup
	DEMO_MODULE=flashrt_ros.demo_policy bash scripts/run_demo.sh

demo-speech: setup
	DEMO_MODULE=flashrt_ros.demo_speech bash scripts/run_demo.sh

# Run from build/bench-results so the installed package (with the generated msg/srv modules
# that fig5 needs) is imported, not the source folder. Extra options: make bench ARGS='--only fig2'
BENCH_OUT = build/bench-results

# llama.cpp beside the runtime (fig4, fig7) when build/peer-venv exists (make bench-peer).
PEER_PYTHON = $(CURDIR)/build/peer-venv/bin/python
PEER_ARGS = $(if $(wildcard $(PEER_PYTHON)),--peer-python $(PEER_PYTHON))

bench: setup
	mkdir -p $(BENCH_OUT) && . ./env.sh && cd $(BENCH_OUT) && python -m flashrt_ros.bench --out . $(PEER_ARGS) $(ARGS)

bench-quick: setup
	mkdir -p $(BENCH_OUT) && . ./env.sh && cd $(BENCH_OUT) && python -m flashrt_ros.bench --quick --out . $(ARGS)

# Build llama.cpp (llama-cpp-python, from source: minutes) into build/peer-venv, then run the
# figures that measure it beside the runtime. Not part of `make test`.
bench-peer: setup
	bash scripts/peer_env.sh
	mkdir -p $(BENCH_OUT) && . ./env.sh && cd $(BENCH_OUT) && python -m flashrt_ros.bench --out . --peer-python $(PEER_PYTHON) --only fig4,fig7 $(ARGS)

# ACT against LeRobot 0.4.4 itself (parity and time per chunk) in build/lerobot-venv (~6 GB).
LEROBOT_PYTHON = $(CURDIR)/build/lerobot-venv/bin/python

bench-lerobot: setup
	bash scripts/lerobot_env.sh
	mkdir -p $(BENCH_OUT) && . ./env.sh && cd $(BENCH_OUT) && python -m flashrt_ros.bench.lerobot_parity --out . --lerobot-python $(LEROBOT_PYTHON) $(ARGS)

clean:
	rm -rf build install log env.sh
