"""``FSDP.summon_full_params(...)`` (also called through an instance)."""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, names_from, short, walk
from fsdp_bridge.migrate._names import FSDP, NAMES
from fsdp_bridge.migrate._scan_base import ScannerBase
from fsdp_bridge.migrate._torch_helpers import HELPERS_NAME

_NOT_A_FORWARD = frozenset(
    {
        *("state_dict", "load_state_dict", "parameters", "named_parameters", "buffers", "named_buffers"),
        *("modules", "named_modules", "children", "named_children", "eval", "train", "to", "cpu", "cuda"),
        *("half", "float", "bfloat16", "requires_grad_", "zero_grad", "save_pretrained", "get_submodule"),
    }
)
"""Methods of a module that run no forward (nothing of them gathers on FSDP2)."""


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
            and code_of(func.value) not in ("fsdp_bridge", HELPERS_NAME)  # a migrated call (either target)
            and len(node.args) >= 1
            and node.args[0].keyword is None
            and node.args[0].star == ""
            and not any(q.name.startswith("fsdp_bridge") for q in self.get_metadata(QualifiedNameProvider, func, set()))
        )
        if bound_summon or (hit is not None and hit[0] == FSDP and hit[1] == "summon_full_params"):
            construct = f"{short(code_of(func), 40)}(...)" if bound_summon else "FSDP.summon_full_params(...)"
            ok = (
                len(node.args) >= 1
                # FSDP1's module by position, or by keyword (``summon_full_params(module=model, ...)``)
                and (node.args[0].keyword is None or node.args[0].keyword.value == "module")
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
            both = self._fsdp2_admitted_around(node, code_of(node.args[0].value)) if ok else None
            if both is not None:
                self._summon_for_both(node, construct, both)
                self._consume(node.func)
                return True, None
            held = self._params_held_across(node, code_of(node.args[0].value)) if ok else None
            if held is None and ok and own and "writeback" not in kws:
                held = self._writes_inside(node)
            if held is None and ok and own:
                held = self._state_dict_inside(node, code_of(node.args[0].value))
            if held is None and ok and own:
                held = self._values_read_inside(node, code_of(node.args[0].value))
            if held is None and ok and not own:
                held = self._load_inside(node, code_of(node.args[0].value))
            if held is None and ok and not own and kws.get("rank0_only") == "True":
                held = self._one_rank_forward_inside(node, code_of(node.args[0].value))
            if held is not None:
                self._record(node, construct, held, False)
                self._consume(node.func)
                return True, None
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

    def _summon_for_both(self, node: cst.Call, construct: str, guard: str) -> None:
        """FSDP1's static summon_full_params under a test that holds for torch's own ``fully_shard`` modules too
        (``if fsdp_version(m) > 0:``): for those FSDP1's call gathers nothing, and after migration every module
        the test admits is an FSDP2 module. Where the block is the ``with``'s only item and reads DTensors itself
        (``full_tensor()``, ``to_local()``), it was written for ungathered FSDP2 modules: the context goes and
        the block stays. Elsewhere a TODO: fsdp_bridge.summon_full_params would gather modules FSDP1's call left
        alone."""
        target = short(code_of(node.args[0].value), 30)
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        reads = (
            sorted(
                {
                    n.attr.value
                    for n in walk(stmt.body)
                    if isinstance(n, cst.Attribute) and n.attr.value in ("full_tensor", "to_local", "redistribute")
                }
            )
            if isinstance(stmt, cst.With)
            and len(stmt.items) == 1
            and stmt.items[0].item is node
            and stmt.items[0].asname is None
            else []
        )
        if reads and isinstance(stmt, cst.With) and self.dispatch.constructs_fsdp1 is None:
            # no file of the tree makes an FSDP1 model: a library hands them over (accelerate's FSDP plugin, a
            # Trainer) and may keep doing so after the migration; FSDP1's call serves those, the block the others
            self._record(
                node,
                construct,
                f"kept as is: no file of this tree makes an FSDP1 model, so the modules `{short(guard, 40)}` admits "
                "come from a library (accelerate's FSDP plugin, a Trainer's) and may stay FSDP1's, which this call "
                f"gathers; for torch's own fully_shard modules it gathers nothing and the block reads their DTensors "
                f"itself ({', '.join(r + '()' for r in reads)}); migrate that library's config to FSDP2 "
                "(fsdp-bridge migrate config) and the context can go",
                True,
            )
            return
        if reads and isinstance(stmt, cst.With):
            self.unwrap_withs.add(id(stmt))
            self._record(
                node,
                construct,
                f"the context goes, its block stays: `{short(guard, 40)}` holds for torch's own fully_shard "
                f"modules too, for which FSDP1's static summon_full_params gathers nothing, and the block reads "
                f"their DTensors itself ({', '.join(r + '()' for r in reads)}); after migration every module it "
                "admits is an FSDP2 module, so that path serves them all (fsdp_bridge.summon_full_params would "
                "gather each whole module at once)",
                True,
            )
            return
        self._record(
            node,
            construct,
            f"not rewritten: `{short(guard, 40)}` holds for torch's own fully_shard modules too, for which FSDP1's "
            "static summon_full_params gathers nothing, while fsdp_bridge.summon_full_params would gather them; "
            "after migration every module it admits is an FSDP2 module: drop the context where the block "
            f"handles DTensor shards (as it does for fully_shard modules), or use fsdp_bridge.summon_full_params("
            f"{target}, writeback=...) where it needs full tensors",
            False,
        )

    def _state_dict_inside(self, node: cst.Call, target: str) -> str | None:
        """``with FSDP.summon_full_params(target, recurse=False): ... target.state_dict()`` (or ``target.module``'s,
        a state dict of something under it): FSDP1 gave the unit's gathered tensors; on FSDP2 recurse=False is the
        unit's unshard(), inside which its state_dict() still gives DTensor shards (FSDP2's state-dict hooks), in
        param_dtype under mixed precision. A TODO that names the form that gathers."""
        n = self._method_in_block(node, "state_dict", lambda owner: owner == target or owner.startswith(target + "."))
        if n is not None and isinstance(n.func, cst.Attribute):
            return (
                f"not rewritten: {short(code_of(n.func.value), 40)}.state_dict() inside it took the unit's "
                "gathered tensors on FSDP1; on FSDP2 recurse=False is the unit's unshard(), inside which "
                "state_dict() still gives DTensor shards (in param_dtype under mixed precision): drop "
                f"recurse=False (fsdp_bridge.summon_full_params({short(target, 30)}) gathers the nested units "
                "too, as full copies in the parameters' own dtype)"
            )
        return None

    def _values_read_inside(self, node: cst.Call, target: str) -> str | None:
        """``with FSDP.summon_full_params(target, recurse=False): <no forward of target>`` in a tree wrapping with
        mixed precision: FSDP1 gathered the unit's parameters in full precision (it always does in
        summon_full_params); FSDP2's unshard, which recurse=False becomes, gathers them in ``param_dtype``, so
        the values read inside (weights handed to an inference engine, a checksum) would be rounded. Around a
        forward or ``generate`` the rounding is what the forward computes with anyway; elsewhere a TODO."""
        where = self.dispatch.mixed_precision
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if where is None or not isinstance(stmt, cst.With) or not any(i.item is node for i in stmt.items):
            return None
        for n in walk(stmt.body):
            if isinstance(n, cst.Call) and (
                code_of(n.func) == target
                or (isinstance(n.func, cst.Attribute) and n.func.attr.value in ("generate", "forward"))
            ):
                return None
        where = "this file" if where == self.path else where
        return (
            f"not rewritten: FSDP1's summon_full_params gathers full precision, and {where} wraps with "
            "mixed_precision=: on FSDP2 recurse=False is the unit's unshard(), which gathers in MixedPrecision's "
            "param_dtype, so the values read inside would be rounded to it (the same where the parameters are "
            f"already that dtype); fsdp_bridge.summon_full_params({short(target, 30)}, writeback=False) without "
            "recurse=False gathers full-precision copies (of the nested units' parameters too)"
        )

    def _method_in_block(self, node: cst.Call, method: str, owner: Callable[[str], bool]) -> cst.Call | None:
        """The first ``x.<method>(...)`` call, ``owner(x as code)`` true, in the body of the ``with`` whose item is
        ``node``; None where there is none (or ``node`` is not a ``with`` item)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, cst.With) or not any(i.item is node for i in stmt.items):
            return None
        for n in walk(stmt.body):
            if (
                isinstance(n, cst.Call)
                and isinstance(n.func, cst.Attribute)
                and n.func.attr.value == method
                and owner(code_of(n.func.value))
            ):
                return n
        return None

    def _load_inside(self, node: cst.Call, target: str) -> str | None:
        """``with FSDP.summon_full_params(target): ... target.load_state_dict(sd)``: FSDP1 loaded into the
        gathered parameters; on FSDP2 the load (rewritten to torch's full-state load, which needs no gather)
        fails inside the bridge's summon, whose full copies FSDP2's load hooks refuse. A TODO: the context goes."""
        if self._method_in_block(node, "load_state_dict", lambda owner: owner == target) is not None:
            return (
                f"not rewritten: {short(target, 30)}.load_state_dict(...) inside it loaded into the gathered "
                "parameters on FSDP1; the migrated load (torch's set_model_state_dict with "
                "full_state_dict=True) takes the full state by itself, and fails inside "
                "fsdp_bridge.summon_full_params, whose full copies FSDP2's load hooks refuse: remove this "
                "context (FSDP1's, kept here, does nothing to an FSDP2 model)"
            )
        return None

    def _writes_inside(self, node: cst.Call) -> str | None:
        """Why ``summon_full_params(m, recurse=False)`` with FSDP1's default ``writeback=True`` cannot be rewritten
        where its block changes tensors in place (``p.data.mul_(...)``, ``w.copy_(...)``, ``p.data = ...``,
        ``load_state_dict``): FSDP1 keeps such changes, while the unit's ``unshard()`` on FSDP2 gathers into
        buffers its ``reshard()`` frees, so they would be lost. None where the block writes nothing."""
        block = self._with_block_of(node)
        if block is None:
            return None
        loop_params = {  # names bound by ``for p in ....parameters()``
            code_of(n.target)
            for n in walk(block.body)
            if isinstance(n, cst.For)
            and any(
                isinstance(c, cst.Call)
                and isinstance(c.func, cst.Attribute)
                and c.func.attr.value in ("parameters", "named_parameters")
                for c in walk(n.iter)
            )
        }

        def parameter_like(expr: cst.BaseExpression) -> bool:
            """A parameter: one the block's loop takes from ``parameters()``, or a ``.data`` / ``.weight`` /
            ``.bias`` read (not a tensor of the block's own, such as logits scaled in place)."""
            text = code_of(expr)
            root = text.split(".", 1)[0].split("[", 1)[0]
            return root in loop_params or any(f".{a}" in text for a in ("data", "weight", "bias"))

        for n in walk(block.body):
            write = None
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute):
                name = n.func.attr.value
                if name == "load_state_dict":
                    write = code_of(n.func)
                elif name.endswith("_") and not name.startswith("_"):
                    receiver = n.func.value
                    if parameter_like(receiver) or (  # torch.nn.init.normal_(p), torch.zero_(w.data)
                        n.args and code_of(receiver).split(".", 1)[0] == "torch" and parameter_like(n.args[0].value)
                    ):
                        write = code_of(n.func)
            elif isinstance(n, cst.Assign):
                for t in n.targets:
                    if (isinstance(t.target, cst.Attribute) and t.target.attr.value in ("data", "weight", "bias")) or (
                        isinstance(t.target, cst.Subscript) and parameter_like(t.target.value)
                    ):
                        write = code_of(t.target)
            elif isinstance(n, cst.AugAssign) and parameter_like(n.target):
                write = code_of(n.target)
            if write is not None:
                return (
                    f"not rewritten: the block changes parameters in place ({short(write, 40)}), and FSDP1's "
                    "summon_full_params(recurse=False) keeps such changes (its default writeback=True), while "
                    "FSDP2's unshard() of the unit (what fsdp_bridge.summon_full_params(model, recurse=False) does) "
                    "gathers into buffers that reshard() frees, so they would be lost; make the changes under "
                    "fsdp_bridge.summon_full_params(model, writeback=True) (every parameter under the model, "
                    "written back to the shards; no forward inside it), apart from any forward or generate"
                )
        return None

    def _with_block_of(self, node: cst.Call) -> cst.With | None:
        """The ``with`` statement of the current function (or module) whose items hold ``node``."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return None
        return next(
            (w for w in walk(scope) if isinstance(w, cst.With) and any(item.item is node for item in w.items)), None
        )

    def _one_rank_forward_inside(self, node: cst.Call, module: str) -> str | None:
        """Why a ``rank0_only=True`` context cannot be rewritten where, inside it, an ``if`` testing the rank
        calls the model (or a name the function took from it: ``raw = model.module``): FSDP1's wrapped module
        runs there on rank 0 alone without a collective (its units gathered already); FSDP2's units gather in
        their own forward, an all-gather the other ranks never join. None where no such call is made. The
        context is the ``with`` holding the call, or the one entering a name the call was assigned to
        (``ctx = FSDP.summon_full_params(...)`` then ``with ctx:``)."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return None
        blocks = [b for b in [self._with_block_of(node)] if b is not None]
        held = {
            t.target.value
            for a in walk(scope)
            if isinstance(a, cst.Assign) and any(n is node for n in walk(a.value))
            for t in a.targets
            if isinstance(t.target, cst.Name)
        }
        blocks += [
            w for w in walk(scope) if isinstance(w, cst.With) and any(code_of(item.item) in held for item in w.items)
        ]
        root = module.split(".")[0].split("(")[0]
        # the model's names in the function: taken from it (raw = model.module), or it from them (w = model)
        names = names_from(scope, {root}, back=True)
        for block in blocks:
            for test in walk(block.body):
                if not isinstance(test, cst.If) or "rank" not in code_of(test.test).lower():
                    continue
                call = next(
                    (
                        c
                        for c in walk(test.body)
                        if isinstance(c, cst.Call)
                        and (
                            (isinstance(c.func, cst.Name) and c.func.value in names)
                            or (
                                isinstance(c.func, cst.Attribute)
                                and isinstance(c.func.value, cst.Name)
                                and c.func.value.value in names
                                and c.func.attr.value not in _NOT_A_FORWARD
                            )
                        )
                    ),
                    None,
                )
                if call is not None:
                    return (
                        f"a forward on one rank inside it ({short(code_of(call.func), 40)}(...) under "
                        f"`if {short(code_of(test.test), 40)}`): FSDP1's wrapped module runs there without a "
                        "collective (its units gathered already); FSDP2's units gather their parameters in their "
                        "own forward, an all-gather the other ranks never join (a hang). Run the forward on every "
                        "rank (rank 0 keeps the outputs) inside fsdp_bridge.summon_full_params(model) without "
                        "rank0_only, or on rank 0 load get_model_state_dict(model, options=StateDictOptions("
                        "full_state_dict=True, cpu_offload=True)) into an unsharded copy of the model and run that"
                    )
        return None

    def _params_held_across(self, node: cst.Call, module: str) -> str | None:
        """Why the context cannot be rewritten where parameter objects taken before it are read inside it
        (``params = list(model.parameters())`` ... ``with FSDP.summon_full_params(model): use(params)``);
        None where none are. FSDP1 re-points such objects to the full data; FSDP2 gathers into new tensors and
        the objects taken before stay sharded DTensors, so a silent rewrite would hand shards on.

        Only parameters of ``module`` (the context's model), of a module it contains or of one containing it
        count: taken from the same expression or one extending it (``model``, ``model.layer``, ``model.module``).
        Parameters of another model (``a.net.parameters()`` around ``summon_full_params(b.net)``) are not
        gathered by the context in FSDP1 either, so they change nothing."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        block = self._with_block_of(node)
        if scope is None or block is None:
            return None
        start = self.get_metadata(PositionProvider, block).start.line
        taken: dict[str, str] = {}  # name -> the statement that took the parameters
        for stmt in walk(scope):
            if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1):
                continue
            target = stmt.targets[0].target
            if not isinstance(target, cst.Name) or self.get_metadata(PositionProvider, stmt).start.line >= start:
                continue
            counted = (  # a count or size of the parameters, not the objects
                isinstance(stmt.value, cst.Call)
                and isinstance(stmt.value.func, cst.Name)
                and stmt.value.func.value in ("sum", "len", "int", "float", "max", "min", "any", "all")
            )
            if not counted and any(
                isinstance(c, cst.Call)
                and isinstance(c.func, cst.Attribute)
                and c.func.attr.value in ("parameters", "named_parameters")
                and _of_module(c.func.value, module)
                for c in walk(stmt.value)
            ):
                taken[target.value] = code_of(stmt)
        read = sorted({n.value for n in walk(block.body) if isinstance(n, cst.Name) and n.value in taken})
        if not read:
            return None
        return (
            f"parameter objects taken before the context ({short(taken[read[0]], 60)}) are read inside it: "
            "FSDP1 re-points them to the full data, FSDP2 keeps no parameter identity (they stay sharded "
            "DTensors inside fsdp_bridge.summon_full_params). Take them from the model inside the context "
            "(model.parameters() / named_parameters() there), then use fsdp_bridge.summon_full_params(model, ...)"
        )


def _of_module(owner: cst.BaseExpression, module: str) -> bool:
    """Whether ``owner.parameters()`` may hold parameters of the module written ``module``: the same module, one
    inside or around it, or an expression built on it (``unwrap(model)``, ``model.get_submodule("x")``)."""
    return _same_tree(code_of(owner), module) or any(
        _same_tree(code_of(a.value), module) for c in walk(owner) if isinstance(c, cst.Call) for a in c.args
    )


def _same_tree(owner: str, module: str) -> bool:
    """Whether the module written ``owner`` is ``module``, inside it or around it: one expression extends the
    other by attributes or subscripts (``m`` and ``m.layer``, ``m.module`` and ``m``, ``ms[0]`` and ``ms``)."""
    short_, long_ = sorted((owner.replace(" ", ""), module.replace(" ", "")), key=len)
    return long_ == short_ or (long_.startswith(short_) and long_[len(short_)] in ".[")
