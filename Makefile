# The two commands a newcomer needs: `make demo` and `make test`.
.PHONY: setup demo test lint diagrams

setup:
	@./scripts/setup

demo: setup
	.venv/bin/kvfsm demo

test: setup lint
	.venv/bin/kvfsm diagrams --check
	.venv/bin/python -m pytest --kvfsm-coverage-fail

# Redraw diagrams/ from the declared machines after changing one (needs graphviz's dot).
diagrams: setup
	.venv/bin/kvfsm diagrams

lint: setup
	.venv/bin/ruff check kvfsm tests examples bench
	.venv/bin/mypy
