"""pytest plugin (registered through the ``pytest11`` entry point as ``fsdp_bridge``).

Registers the markers the project's and users' distributed tests use.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
