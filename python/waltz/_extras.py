"""Optional dependencies. The core install is what an application's client needs; every other
feature imports its dependency through `require`, so that a missing extra is one line naming
what to install instead of a bare ModuleNotFoundError deep inside the feature."""

from __future__ import annotations

import importlib
from types import ModuleType

from waltz.errors import MissingExtraError

DISTRIBUTION = "waltz-log"
"""The name to `pip install` (the import name is `waltz`; `waltz` on the index is another project)."""


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Imports `module`, or raises MissingExtraError: "`feature` needs the `extra` extra: pip install ...".

    Only a missing `module` (or a missing parent package of it) is reported so; an import error
    raised inside an installed module propagates unchanged, since installing the extra again
    would not cure it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise
        # `from None`: the ModuleNotFoundError would only repeat the module's name in a second traceback.
        raise MissingExtraError(f"{feature} needs the '{extra}' extra: {install_hint(extra)}") from None


__all__ = ["DISTRIBUTION", "install_hint", "require"]
