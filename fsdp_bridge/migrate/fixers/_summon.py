"""``FSDP.summon_full_params(...)`` (also called through an instance)."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, short
from fsdp_bridge.migrate._names import FSDP, NAMES
from fsdp_bridge.migrate._scan_base import ScannerBase


class SummonFixer(ScannerBase):
    """summon_full_params."""

    def _plan_summon(
        self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
    ) -> tuple[bool, bool | None]:
        """FSDP1's summon_full_params; (handled, what visit_Call returns)."""
        # FSDP1's summon_full_params is a static method, also called through an instance:
        # ``model.summon_full_params(model, writeback=...)`` (FSDPModule has no such method).
        bound_summon = (
            hit is None
            and isinstance(func, cst.Attribute)
            and func.attr.value == "summon_full_params"
            and code_of(func.value) != "fsdp_bridge"
            and len(node.args) >= 1
            and node.args[0].keyword is None
            and node.args[0].star == ""
            and not any(q.name.startswith("fsdp_bridge") for q in self.get_metadata(QualifiedNameProvider, func, set()))
        )
        if bound_summon or (hit is not None and hit[0] == FSDP and hit[1] == "summon_full_params"):
            construct = f"{short(code_of(func), 40)}(...)" if bound_summon else "FSDP.summon_full_params(...)"
            ok = (
                len(node.args) >= 1
                and node.args[0].keyword is None
                and all(
                    a.keyword is not None
                    and a.keyword.value in ("writeback", "recurse", "rank0_only", "offload_to_cpu", "with_grads")
                    for a in node.args[1:]
                )
            )
            kws = {a.keyword.value: code_of(a.value) for a in node.args[1:] if a.keyword is not None}
            own = kws.get("recurse") == "False"  # the unit's own parameters (around generate, typically)
            if own:
                # The bridge's recurse=False gathers what the unit's forward gathers; FSDP2 has no
                # writeback, rank-0-only or offloaded form of that, so those must be literal False.
                ok = ok and all(
                    kws.get(k, "False") == "False" for k in ("writeback", "rank0_only", "offload_to_cpu", "with_grads")
                )
            else:
                ok = ok and kws.get("recurse", "True") == "True"
            if ok:
                self.fixable_calls[id(node)] = "summon"
            self._record(
                node,
                construct,
                "fsdp_bridge.summon_full_params(model, recurse=False): only the unit's own parameters, as in "
                "FSDP1 (FSDP2: the unit's unshard() / reshard(), what its forward gathers), so forward and "
                "generate may run inside while the nested units gather their own"
                if ok and own
                else NAMES["summon_full_params"]
                if ok
                else NAMES["summon_full_params"]
                + "; recurse=False with writeback, rank0_only, offload_to_cpu, with_grads "
                "(or arguments known only at run time) have no FSDP2 form: FSDP2's forward gathers each unit's "
                "parameters itself, so a context held only around forward/generate can be dropped",
                ok,
            )
            self._consume(node.func)
            return True, (False if ok else None)
        return False, None
