"""A start's own accounts (trainer/startup.py): the imports Python compiles from source at every start."""

import importlib
import py_compile
import sys

from trainer import startup


def test_a_package_imported_without_bytecode_is_named_until_its_bytecode_exists(tmp_path, monkeypatch):
    """A package imported from source with no bytecode kept (``PYTHONDONTWRITEBYTECODE``) is named, with what to do;
    once its bytecode exists (written by compileall or a start that may write), it is not; a package not imported
    is never named."""
    (tmp_path / "pkg_nobytecode").mkdir()
    source = tmp_path / "pkg_nobytecode" / "__init__.py"
    source.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    importlib.import_module("pkg_nobytecode")
    assert startup.uncached_imports(("pkg_nobytecode", "pkg_never_imported")) == ["pkg_nobytecode"]
    note = startup.bytecode_note(["pkg_nobytecode"])
    assert "PYTHONDONTWRITEBYTECODE is set" in note and "compileall" in note and "PYTHONPYCACHEPREFIX" in note
    py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)))
    assert startup.uncached_imports(("pkg_nobytecode",)) == []
    sys.modules.pop("pkg_nobytecode")
