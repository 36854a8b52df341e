"""Test-suite settings.

Hypothesis profiles: ``ci`` (default) keeps the property tests to a bounded sample;
``HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_config_properties.py`` runs
ten thousand examples per property.  Long fault-injection loops are marked ``slow`` and
left out by default: ``python -m pytest -m slow`` runs them.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=800)
settings.register_profile("thorough", max_examples=10_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
