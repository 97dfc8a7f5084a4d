"""A package's names imported on first use (PEP 562's module ``__getattr__``): ``bigtrain`` and
``bigtrain.data`` keep torch out of the commands that build nothing (presets, fields, config)."""

from __future__ import annotations

from importlib import import_module


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict):
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module path) the
    first time ``name`` is read and keeps the value in ``namespace`` (the package's globals())."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module '{package}' has no attribute {name!r}")
        value = getattr(import_module(exports[name]), name)
        namespace[name] = value  # once
        return value

    return __getattr__
