# The two commands a newcomer needs: `make demo` and `make test`.
.PHONY: setup demo test lint diagrams docs

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

# The API reference, generated from the docstrings by pdoc into build/api (git-ignored): kvfsm
# and each of its modules without a leading "_", each showing what its __all__ says is public.
# Warnings are errors; tests/test_api.py runs this same command, so `make test` (CI) checks it.
API_MODULES = kvfsm $$(.venv/bin/python -c 'import pkgutil, kvfsm; print(*(m.name for m in \
	pkgutil.walk_packages(kvfsm.__path__, "kvfsm.") if "._" not in m.name))')

docs: setup
	rm -rf build/api
	.venv/bin/python -W error -m pdoc --docformat google --no-show-source --output-directory build/api $(API_MODULES)
	@echo "the API reference: build/api/index.html"
