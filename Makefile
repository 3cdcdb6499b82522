# The two commands a newcomer needs: `make demo` and `make test`.
.PHONY: setup demo test lint

setup:
	@./scripts/setup

demo: setup
	.venv/bin/kvfsm demo

test: setup lint
	.venv/bin/python -m pytest

lint: setup
	.venv/bin/ruff check kvfsm tests
	.venv/bin/mypy
