# The two commands a newcomer needs: `make demo` and `make test`.
.PHONY: setup demo test lint diagrams docs mutation

setup:
	@./scripts/setup

demo: setup
	.venv/bin/kvfsm demo

# the tests need vLLM 0.33 too (kvfsm.vllm is tested under vLLM's own manager): installed once,
# about 3 minutes and 2.4 GB the first time (scripts/install-vllm)
test: setup lint
	./scripts/setup --vllm
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
# PDOC_ALLOW_EXEC: importing vLLM (for kvfsm.vllm) runs `uname -p`, which pdoc blocks by default.
API_MODULES = kvfsm $$(.venv/bin/python -c 'import pkgutil, kvfsm; print(*(m.name for m in \
	pkgutil.walk_packages(kvfsm.__path__, "kvfsm.") if "._" not in m.name))')

docs: setup
	./scripts/setup --vllm  # kvfsm.vllm's reference imports vLLM
	rm -rf build/api
	PDOC_ALLOW_EXEC=1 .venv/bin/python -W error -m pdoc --docformat google --no-show-source --output-directory build/api $(API_MODULES)
	@echo "the API reference: build/api/index.html"

# Mutation testing on demand, not in `make test` or CI (over an hour on 2 cores for all six
# modules: run one or two at a time with MUTANTS, as docs/testing.md shows): installs
# mutmut (pyproject.toml's "mutation" extra) into .venv and runs it in a copy of the tree under
# build/mutation, over the modules [tool.mutmut] names, against the fast tests; prints the score
# per module and the mutants that survived. One module: `make mutation MUTANTS='kvfsm.runner.*'`.
# docs/testing.md keeps the last scores and a verdict on each survivor.
mutation: setup
	set -f; ./scripts/mutation $(MUTANTS)  # set -f: the names are globs for mutmut, not files
