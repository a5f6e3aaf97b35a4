# Fresh machine (Debian/Ubuntu x86_64, Python 3.10+, no ROS): `make demo`, `make test`.
.PHONY: setup test demo bench bench-quick lint clean

setup:
	bash scripts/bootstrap.sh

test: setup
	bash scripts/run_tests.sh

lint: setup
	bash scripts/run_tests.sh test/test_lint.py

demo: setup
	bash scripts/run_demo.sh

bench: setup
	. ./env.sh && python -m flashrt_ros.bench

bench-quick: setup
	. ./env.sh && python -m flashrt_ros.bench --quick

clean:
	rm -rf build install log env.sh
