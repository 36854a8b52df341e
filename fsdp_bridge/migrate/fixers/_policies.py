"""Wrap, mixed-precision and CPU-offload policies and the other constructor argument values: what each
becomes on the bridge."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import Conversion, class_list, code_of, make_str, short, walk
from fsdp_bridge.migrate._names import (
    FSDP1_POSITIONAL,
    KWARG_OPTION,
    OLD_WRAP_KWARG,
    STRATEGIES,
    fsdp2_any,
    fsdp2_case,
    keep_low_precision_text,
)
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase

OFFLOAD_BACKEND = "cuda:nccl,cpu:gloo"
SIZE_POLICIES = ("size_based_auto_wrap_policy", "default_auto_wrap_policy")
"""FSDP1's size policy, under its name and torch 1.11's."""
SIZE_POLICY_DEFAULT = 100_000_000
"""Its ``min_num_params`` where none is given (``int(1e8)``)."""
_INIT_PROCESS_GROUP = {"torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group"}


class PolicyFixer(ScannerBase):
    """Constructor argument values and policies."""

    def _plan_offload_backend(self, node: cst.Call) -> None:
        """``dist.init_process_group("nccl", ...)`` in a tree that offloads parameters
        (``CPUOffload(offload_params=True)``) -> ``"cuda:nccl,cpu:gloo"``: FSDP2's offloaded gradients are CPU
        DTensors, and a collective over them (torch's clip_grad_norm_ or any global norm, a scaler's overflow
        check) needs a CPU backend, where FSDP1's were plain tensors that no collective touched. CUDA tensors
        still go through NCCL. Left as written where the file asks the group for its backend (``get_backend``
        would answer the pair), where a file of the tree asks the group for its backend."""
        if self.planning or self.dispatch.offloads_params is None or self.dispatch.asks_backend is not None:
            return
        if not self.uses_fsdp1 and self._a_script_of_its_own():
            return  # another training script (DDP's) beside the one that offloads: it never sees FSDP2's gradients
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if not names & {
            "torch.distributed.init_process_group",
            "torch.distributed.distributed_c10d.init_process_group",
        }:
            return
        arg = next((a for a in node.args if a.keyword is not None and a.keyword.value == "backend"), None)
        if arg is None and node.args and node.args[0].keyword is None and not node.args[0].star:
            arg = node.args[0]
        if arg is not None and not isinstance(arg.value, (cst.SimpleString, cst.ConcatenatedString)):
            self._note_offload_backend(node, arg.value)
            return
        if arg is None or not isinstance(arg.value, cst.SimpleString) or arg.value.evaluated_value != "nccl":
            return
        quote = arg.value.quote
        self.expr_rewrites[id(arg.value)] = f"{arg.value.prefix}{quote}{OFFLOAD_BACKEND}{quote}"
        self.rewrites_backend = True
        where = self.dispatch.offloads_params
        self._record(
            node,
            f"init_process_group({code_of(arg.value)})",
            f"init_process_group({quote}{OFFLOAD_BACKEND}{quote}): "
            + ("this file" if where == self.path else where)
            + " offloads parameters (CPUOffload(offload_params=True)), and FSDP2's offloaded gradients are CPU "
            "DTensors: a collective over them (torch's clip_grad_norm_ or a global norm of your own, a scaler's "
            "overflow check) needs a CPU backend beside NCCL (an NCCL-only group raises 'No backend type associated "
            "with device type cpu'); FSDP1's were plain tensors no collective touched. CUDA tensors still go "
            "through NCCL",
            True,
        )

    def _a_script_of_its_own(self) -> bool:
        """The file runs as a script (``if __name__ == "__main__":`` at its top level) and no file of the tree
        imports from it (``from <its module> import ...``): its process group is its own."""
        if self.module is None or not any(
            isinstance(stmt, cst.If) and "__name__" in code_of(stmt.test) and "__main__" in code_of(stmt.test)
            for stmt in self.module.body
        ):
            return False
        parts = [p for p in Path(self.path).with_suffix("").parts if p not in ("/", "")]
        mine = {".".join(parts[-k:]) for k in range(1, len(parts) + 1)}
        return not any(name.rpartition(".")[0] in mine or name in mine for name in self.dispatch.from_imports)

    def _note_offload_backend(self, node: cst.Call, backend: cst.BaseExpression) -> None:
        """``init_process_group(backend=<a value known at run time>)`` in a tree that offloads parameters: the
        pair ``"cuda:nccl,cpu:gloo"`` cannot be written for it, so a note says when it is needed."""
        where = self.dispatch.offloads_params
        pos = self.get_metadata(PositionProvider, node).start
        value = short(code_of(backend), 40)
        self.findings.append(
            CodeFinding(
                self.path,
                pos.line,
                pos.column,
                f"init_process_group({value})",
                f"left as it is; {'this file' if where == self.path else where} offloads parameters "
                "(CPUOffload(offload_params=True)), and FSDP2's offloaded gradients are CPU DTensors: a collective "
                "over them (torch's clip_grad_norm_ or a global norm of your own, a scaler's overflow check) needs a "
                f'CPU backend beside NCCL. Where {value} is "nccl" on an offloading run, make it '
                f'"{OFFLOAD_BACKEND}" (an NCCL-only group raises \'No backend type associated with device type '
                "cpu'); FSDP1's offloaded gradients were plain tensors no collective touched",
                True,
                note=True,
            )
        )

    def _describe_value(self, kw: str, value: cst.BaseExpression) -> str:
        """What an FSDP1 argument's value becomes, as far as the source shows it."""
        option = KWARG_OPTION.get(kw, kw)
        if kw == "ignored_parameters":
            return (
                "torch 2.0's name of ignored_states (torch >= 2.1 refuses it): parameter objects -> their paths in "
                "ignored_modules (fsdp_bridge.module_names, when the code runs): not sharded, gradients not reduced "
                "across ranks, as in FSDP1"
            )
        if kw == OLD_WRAP_KWARG:
            return (
                "torch 1.11's name of auto_wrap_policy (torch >= 1.12 refuses it), read as auto_wrap_policy: "
                + fsdp2_any(KWARG_OPTION.get("auto_wrap_policy", "auto_wrap_policy"))
            )
        if kw not in FSDP1_POSITIONAL:
            return "not an argument of FullyShardedDataParallel in torch >= 2.1 (see the FSDP(...) line)"
        if kw == "sharding_strategy":
            member = self._member(value, "ShardingStrategy")
            if member in STRATEGIES:
                return f"{member}: {fsdp2_case('strategy', STRATEGIES[member])}"
            target = code_of(value)
            assigned = sorted(
                {
                    member
                    for n in (walk(self.module) if self.module is not None else ())
                    if isinstance(n, cst.Assign)
                    and any(code_of(t.target) == target for t in n.targets)
                    and (member := self._member(n.value, "ShardingStrategy")) in STRATEGIES
                }
            )
            if assigned:  # the values this file gives it: say what each becomes
                cases = "; ".join(f"{mm}: {fsdp2_case('strategy', STRATEGIES[mm])}" for mm in assigned)
                return f"chosen at run time among {', '.join(assigned)} (assigned in this file); {cases}"
            return (
                "known at run time; each strategy keeps its meaning (FULL_SHARD / SHARD_GRAD_OP a 1D mesh, "
                "resharded after forward or not; HYBRID_* a (replicate, shard) mesh; NO_SHARD a (world, 1) "
                "mesh, or (n, 1) over a mesh given); "
                "fsdp_bridge.get_bridge(model).report shows what it became"
            )
        if kw == "auto_wrap_policy":
            return (
                "the modules FSDP1's policy picks when the code runs (policy functions run FSDP1's own auto-wrap "
                "recursion): " + fsdp2_case("wrap", "auto / classes / min_num_params / callable")
            )
        if kw == "mixed_precision" and code_of(value) in ("False", "None", "0"):
            # FSDP1 reads `mixed_precision or MixedPrecision()`
            return f"{code_of(value)}: full precision (FSDP2: no MixedPrecisionPolicy), as in FSDP1"
        if kw == "mixed_precision":
            return "MixedPrecision's param/reduce/buffer dtypes -> MixedPrecisionPolicy (buffers cast once)"
        if kw == "cpu_offload" and code_of(value) in ("False", "None", "CPUOffload()", "CPUOffload(False)"):
            return f"{code_of(value)}: nothing offloaded (FSDP2: no OffloadPolicy), as in FSDP1"
        if kw == "cpu_offload":
            return (
                "CPUOffload(offload_params=True) -> CPUOffloadPolicy on a GPU run; on a CPU-only run the "
                "parameters already live in host memory and nothing is offloaded; offload_params=False -> nothing "
                "offloaded"
            )
        if kw == "backward_prefetch":
            return (
                "BACKWARD_PRE is FSDP2's implicit order; None (no prefetch) runs on FSDP2 as in FSDP1 (each unit "
                "gathers itself before its backward); BACKWARD_POST becomes BACKWARD_PRE's timing (the same numbers, "
                "a note when the code runs; written as BACKWARD_POST, a TODO); any other value (True, a string) is no "
                "prefetch, as FSDP1 takes it"
            )
        if kw == "use_orig_params":
            return (
                "FSDP2 always keeps one parameter per original one, what use_orig_params=True asks of FSDP1, and "
                "keeps its shape too (a DTensor, never flattened), where FSDP1's was this rank's 1-D slice outside "
                "forward: code reading p.shape / p.ndim of the parameters (an optimizer grouping them by dimension) "
                "sees the full shapes now; its name is the module's own, without the _fsdp_wrapped_module. "
                "prefixes FSDP1's named_parameters() gave; the parameter objects are new, so an optimizer is built "
                "after the shard call"
            )
        if kw in ("ignored_modules", "ignored_states"):
            return (
                "module (or parameter) objects -> their paths in the model (fsdp_bridge.module_names, when the "
                "code runs): not sharded, gradients not reduced across ranks, as in FSDP1"
            )
        if kw == "process_group" and code_of(value) != "None":
            return (
                "shard(..., mesh=fsdp_bridge.mesh_from_process_group(<the group>)) when the code runs: a group of "
                "some ranks (the data-parallel group of a model-parallel setup) -> a 1D DeviceMesh over them, each "
                "group sharding its own copy as in FSDP1; HYBRID_SHARD's (intra-node, inter-node) pair -> a 2D "
                "(replicate, shard) mesh of those groups; the world group -> the bridge's mesh over every rank"
            )
        if kw == "process_group":
            return "None: the bridge's mesh over every rank"
        if kw in ("forward_prefetch", "limit_all_gathers", "sync_module_states"):
            return (
                f"{kw}={code_of(value)}: " + fsdp2_case(option, code_of(value).lower())
                if code_of(value) in ("True", "False") and kw != "limit_all_gathers"
                else fsdp2_any(option)
            )
        if kw == "device_id":
            return (
                "the device of the run (a CUDA device -> cuda: this rank's GPU is cuda:LOCAL_RANK, or "
                "torch.cuda.current_device() where no launcher sets LOCAL_RANK, so set it with torch.cuda.set_device "
                "as FSDP1 expects; torch.device('cpu') -> cpu)"
            )
        if kw == "param_init_fn":
            return (
                "called as FSDP1 calls it: on each rank's meta-device modules (reset_parameters() without it), in "
                "FSDP1's order, before sharding; with sync_module_states=True every rank then takes rank 0's "
                "values and dtypes"
            )
        return fsdp2_any(option)

    def _member(self, value: cst.BaseExpression, enum_name: str) -> str | None:
        hit = self._qn(value)
        if hit is not None and hit[0] == enum_name:
            return hit[1]
        return None

    def _follow_classes(self, expr: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression:
        """A variable holding the block classes stands for its value only where that is a set, list or tuple of
        class names written out (``layer_cls = {Block}``); one computed by code (``get_layer_cls(model)``) stays the
        variable: written again in its place, the code would run a second time, later, on what may have changed."""
        followed = self._follow(expr, conv)
        if followed is expr or (
            isinstance(followed, (cst.Set, cst.List, cst.Tuple))
            and all(isinstance(e.value, (cst.Name, cst.Attribute)) for e in followed.elements)
        ):
            return followed
        conv.consumed.remove(cast(cst.Name, expr).value)
        return expr

    def _wrap(self, value: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression | None:
        if m.matches(value, m.Name("None")):
            return make_str("none")
        if isinstance(value, (cst.Name, cst.Attribute)) and (hit := self._qn(value)) and hit[0] in SIZE_POLICIES:
            # the policy itself, not a partial: its own min_num_params default
            return cst.parse_expression(f'{{"min_num_params": {SIZE_POLICY_DEFAULT}}}')
        if isinstance(value, cst.Call):
            hit = self._qn(value.func)
            fn_qn = {q.name for q in self.get_metadata(QualifiedNameProvider, value.func, set())}
            if "functools.partial" in fn_qn and value.args:
                self.consumed_partial = True
                inner = self._qn(value.args[0].value)
                kwargs = {a.keyword.value: a.value for a in value.args[1:] if a.keyword}
                if inner and inner[0] == "transformer_auto_wrap_policy" and "transformer_layer_cls" in kwargs:
                    return class_list(self._follow_classes(kwargs["transformer_layer_cls"], conv))
                if inner and inner[0] in SIZE_POLICIES and set(kwargs) == {"min_num_params"}:
                    return cst.parse_expression(f'{{"min_num_params": {code_of(kwargs["min_num_params"])}}}')
            if hit and hit[0] == "ModuleWrapPolicy" and len(value.args) == 1:
                return class_list(self._follow_classes(value.args[0].value, conv))
        conv.blockers.append(
            f"auto_wrap_policy={code_of(value)}: only transformer_auto_wrap_policy, "
            "size_based_auto_wrap_policy (min_num_params) and ModuleWrapPolicy are converted; "
            "give BridgeConfig(wrap=callable) for the rest"
        )
        return None

    def _mixed_precision(self, value: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression | None:
        if m.matches(value, m.Name("None")):
            return None
        if isinstance(value, cst.Call):
            hit = self._qn(value.func)
            if hit and hit[0] == "MixedPrecision" and all(a.keyword for a in value.args):
                items = []
                for a in value.args:
                    assert a.keyword is not None
                    kw = a.keyword.value
                    if kw in (
                        "param_dtype",
                        "reduce_dtype",
                        "buffer_dtype",
                        "cast_forward_inputs",
                        "cast_root_forward_inputs",
                    ):
                        items.append(f'"{kw}": {code_of(a.value)}')
                    elif kw == "keep_low_precision_grads" and code_of(a.value) == "False":
                        continue
                    else:
                        if kw == "keep_low_precision_grads":
                            # read when the code runs (from_fsdp1), not with FSDP1's meaning: the TODO a second
                            # --fix would write at the MixedPrecision(...) left in the from_fsdp1 call
                            text = keep_low_precision_text(code_of(a.value))
                            self._record(value.func, code_of(value.func), text, False)
                        conv.blockers.append(f"MixedPrecision({kw}=...): {fsdp2_any(kw)}")
                        return None
                given = {a.keyword.value for a in value.args if a.keyword is not None}
                if "param_dtype" in given and "cast_forward_inputs" not in given:
                    items.append('"cast_forward_inputs": False')  # FSDP1's default: only the root casts
                return cst.parse_expression("{" + ", ".join(items) + "}")
        conv.blockers.append(f"mixed_precision={code_of(value)}: not a MixedPrecision(...) call with keywords")
        return None

    def _cpu_offload(self, value: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression | None:
        if m.matches(value, m.Name("None")):
            return None
        if m.matches(value, m.Name("False")):
            return cst.Name("False")  # FSDP1 reads `cpu_offload or CPUOffload()`: nothing offloaded
        if isinstance(value, cst.Call):
            hit = self._qn(value.func)
            if hit and hit[0] == "CPUOffload":
                if not value.args:
                    return cst.Name("False")
                if len(value.args) == 1 and (
                    value.args[0].keyword is None or value.args[0].keyword.value == "offload_params"
                ):
                    return value.args[0].value
        conv.blockers.append(f"cpu_offload={code_of(value)}: not a CPUOffload(offload_params=...) call")
        return None
