"""Tiny Hugging Face models built offline from small configs (no download).

``build_tiny(family, seed=0)`` returns a freshly initialised model; the same seed
gives identical weights in every process.  ``sample_batch`` makes matching inputs.

The implementation lives in :mod:`fsdp_bridge._tiny_models`, which compare jobs use
(``model: {family: llama}``): production code never imports ``fsdp_bridge.testing``.
"""

from fsdp_bridge._tiny_models import DECODER_SIZES, FAMILIES, VOCAB, build_tiny, sample_batch, tiny_config

__all__ = ["DECODER_SIZES", "FAMILIES", "VOCAB", "build_tiny", "sample_batch", "tiny_config"]
