"""The public API: what each module's ``__all__`` says, documented, and its reference builds.

What is public is what ``__all__`` says, module by module: every name it lists exists, and a
class or function among them has a docstring of its own. The API reference (``make docs``, pdoc
into ``build/api``) is generated from those docstrings for every module of kvfsm whose name has
no leading ``_``; here the Makefile's command builds it, with any warning of pdoc's an error.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

import kvfsm
from kvfsm.lifecycle import ACTIONS, ANSWERS, GUARDS, TRANSITIONS

ROOT = Path(__file__).resolve().parent.parent


def public_modules() -> list[str]:
    """kvfsm and each of its modules whose dotted name has no part starting with ``_`` (as the
    Makefile's ``docs`` target lists them)."""
    return ["kvfsm", *(module.name for module in pkgutil.walk_packages(kvfsm.__path__, "kvfsm.")
                       if "._" not in module.name)]


MODULES = public_modules()


def module(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_exists_and_a_class_or_function_has_a_docstring(name: str) -> None:
    public = getattr(module(name), "__all__", None)
    assert isinstance(public, list) and public, f"{name} says what is public in __all__"
    assert len(set(public)) == len(public), f"{name}.__all__ repeats a name"
    for attribute in public:
        assert not attribute.startswith("_"), f"{name}.__all__ makes {attribute} public"
        assert hasattr(module(name), attribute), f"{name}.__all__ names {attribute}: not found"
        found = getattr(module(name), attribute)
        if inspect.isclass(found):  # its own, not one inherited from a base class
            assert (vars(found).get("__doc__") or "").strip(), f"{name}.{attribute}: no docstring"
        elif inspect.isfunction(found) or inspect.isbuiltin(found):
            assert (found.__doc__ or "").strip(), f"{name}.{attribute}: no docstring"


def test_the_parts_of_the_transfer_declaration_users_copy_are_public() -> None:
    """A lifecycle of your own starts from the shipped one's answers, guards, actions and
    transitions (examples/verify_lifecycle.py does)."""
    lifecycle = module("kvfsm.lifecycle")
    for part in (ACTIONS, ANSWERS, GUARDS, TRANSITIONS):
        assert [n for n in lifecycle.__all__ if getattr(lifecycle, n) is part], part
    assert {"ACTIONS", "ANSWERS", "GUARDS", "TRANSITIONS"} <= set(lifecycle.__all__)


def test_the_modules_the_reference_covers_are_all_of_kvfsm_but_its_private_ones() -> None:
    assert {"kvfsm", "kvfsm.engine", "kvfsm.lifecycle", "kvfsm.transfer", "kvfsm.tiers",
            "kvfsm.tiering", "kvfsm.peer", "kvfsm.peer_link", "kvfsm.policy", "kvfsm.testing",
            "kvfsm.trace", "kvfsm.nixl_agents", "kvfsm.driver"} <= set(MODULES)
    assert "kvfsm.__main__" not in MODULES, "running it would run the command"


@pytest.mark.timeout(150)  # pdoc imports every module, vLLM's too: ~20 s alone, over 60 s
def test_make_docs_builds_the_reference_of_every_module_without_a_warning(  # on a busy machine
        tmp_path: Path) -> None:
    """The Makefile's own command (``make -n docs`` prints it), run into a directory of the
    test's: pdoc's warnings are errors, and stderr stays empty."""
    recipe = subprocess.run(["make", "-n", "--no-print-directory", "docs"], cwd=ROOT,
                            capture_output=True, text=True, check=False, timeout=30)
    assert recipe.returncode == 0, recipe.stderr
    (command,) = (line for line in recipe.stdout.splitlines() if " -m pdoc " in line)
    assert " -W error " in command and " --output-directory build/api " in command
    out = tmp_path / "api"
    built = subprocess.run(["bash", "-c", command.replace(" build/api ", f" {out} ")],
                           cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert built.returncode == 0 and built.stderr == "", built.stderr[-3000:]
    pages = {path.relative_to(out).as_posix() for path in out.rglob("*.html")}
    assert {f"{name.replace('.', '/')}.html" for name in MODULES} <= pages
    lifecycle = (out / "kvfsm" / "lifecycle.html").read_text()
    assert 'id="TRANSITIONS"' in lifecycle and 'id="ANSWERS"' in lifecycle
