"""What the drivers in this folder share: the package's sample text and stubs for unused imports.

The drivers run with this folder on ``sys.path`` (``fsdp-bridge migrate verify`` puts the driver's
directory there), so they import this module by its name.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from importlib.resources import files
from typing import Any


def sample_words() -> list[str]:
    """The words of the sample text shipped in ``fsdp_bridge/data``."""
    return files("fsdp_bridge").joinpath("data/sample_corpus.txt").read_text().split()


def stub_missing(stubs: dict[str, dict[str, Any]]) -> None:
    """A module with ``attrs`` for each name in ``stubs`` that is not installed (imported by a trainer for
    what the run does not use). Each has a spec: libraries that probe for a module (transformers) need one."""
    for name, attrs in stubs.items():
        try:
            __import__(name)
        except ImportError:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__dict__.update(attrs)
            sys.modules[name] = module
