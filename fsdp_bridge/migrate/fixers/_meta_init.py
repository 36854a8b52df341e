"""Meta-device initialisation: ``param_init_fn=`` without ``sync_module_states``."""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.migrate._analysis import short
from fsdp_bridge.migrate._scan_base import ScannerBase


class MetaInitFixer(ScannerBase):
    """Meta-device initialisation arguments."""

    def _plan_param_init_fn(self, a: cst.Arg, kw: str, value: str, sync: list[str]) -> bool:
        """param_init_fn= for meta-device modules without sync_module_states; True when recorded."""
        if kw == "param_init_fn" and value != "None" and (not sync or sync[0] == "False"):
            # FSDP1 ran the function on every rank's meta-device modules (their own init, no broadcast):
            # BridgeConfig.from_fsdp1 keeps it and runs it so, in FSDP1's order, before sharding.
            self._record(
                a,
                f"{kw}={short(value)}",
                "kept: fsdp_bridge.BridgeConfig.from_fsdp1 runs it as FSDP1 did, on each rank's meta-device "
                "modules (unit by unit, children first, each unit's modules breadth-first) before sharding, so "
                "the same seed gives FSDP1's weights on either backend; a real-device model is left as it is",
                True,
            )
            return True
        return False
