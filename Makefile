# Convenience targets; each script sets up what it needs first.
.PHONY: setup demo test test-all bench wheel clean
setup:
	bash scripts/setup.sh
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
test-all:
	WALTZ_SLOW=1 bash scripts/test.sh
bench:
	bash scripts/setup.sh && .venv/bin/python benches/engine.py
wheel:
	bash scripts/wheel.sh
clean:
	rm -rf .venv target dist
