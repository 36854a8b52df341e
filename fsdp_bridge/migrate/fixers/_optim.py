"""FSDP1's optimizer-state functions (``optim_state_dict``, ``optim_state_dict_to_load``,
``shard_full_optim_state_dict``, ``scatter_full_optim_state_dict``, ...) and optimizers built before the wrap."""

from __future__ import annotations

import re
from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import assign_target, assign_value, code_of, named_args, short, walk
from fsdp_bridge.migrate._names import FSDP, GROUP_RANK0
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase

KERNEL_OPTIMIZER = (
    "not rewritten: bitsandbytes' optimizer kernels take plain tensors (FSDP1's flat shards); on FSDP2 the "
    "parameters are DTensors, which they refuse (fsdp_bridge refuses its first step, naming this): use a "
    "torch.optim optimizer, or keep this model on FSDP1 (on fsdp_bridge: BridgeConfig(backend='fsdp1') on the "
    "shard call)"
)
"""The TODO at a bitsandbytes optimizer in a tree that wraps FSDP1."""

MULTI_TENSOR_KERNEL = (
    "not rewritten: apex's multi-tensor kernels (multi_tensor_applier, as in its FusedAdam / FusedLAMB or a copy of "
    "them) read the storage of plain tensors (FSDP1's flat shards); on FSDP2 the parameters and gradients are "
    "DTensors, which hold none (the step fails, or reads garbage): use torch.optim's fused optimizer "
    "(torch.optim.AdamW(..., fused=True)), hand the kernel each DTensor's local shard (p.to_local(), "
    "p.grad.to_local()), or keep this model on FSDP1 (on fsdp_bridge: BridgeConfig(backend='fsdp1'))"
)
"""The TODO at an apex multi-tensor kernel call or optimizer in a tree that wraps FSDP1."""

FULL_OPTIM_TEXT = (
    "FSDP1's full optimizer state: a CPU copy on rank 0 (rank0_only=True, its default) or on every rank, gathered "
    "one tensor at a time; like FSDP1 it takes a trainer's optimizer wrapper (torch's get_optimizer_state_dict "
    "needs the torch optimizer itself)"
)


def _names_in(node: cst.CSTNode) -> set[str]:
    return {n.value for n in walk(node) if isinstance(n, cst.Name)}


def _followers(body: Sequence[cst.BaseStatement], i: int, j: int, model: str) -> list[int] | None:
    """The statements between an optimizer built at ``body[i]`` and the wrap of ``model`` at ``body[j]`` that use
    it (a scheduler built on it, and what uses those in turn): they move with it. None where one cannot: it is not
    a plain assignment, it names ``model`` (which the wrap rebinds: ``EMA(model, optimizer)`` would take the
    wrapped one), or what it assigns is used by a statement staying before the wrap (or by the wrap)."""
    held = {assign_target(body[i])} - {None}
    followers: list[int] = []
    for k in range(i + 1, j):
        if (names := _names_in(body[k])) & held:
            target = assign_target(body[k])
            if target is None or "." in target or "[" in target or model.split(".")[0] in names:
                return None
            followers.append(k)
            held.add(target)
    moved = {id(body[k]) for k in followers}
    staying = [body[k] for k in range(i + 1, j + 1) if id(body[k]) not in moved]
    if any(_names_in(s) & held for s in staying):
        return None
    return followers


class OptimStateFixer(ScannerBase):
    """Optimizer state."""

    def _note_kernel_optimizer(self, node: cst.Call) -> None:
        """A bitsandbytes optimizer (``bnb.optim.AdamW8bit(...)``, paged or 32-bit) in a tree that wraps FSDP1: a
        TODO. Its update kernels take plain tensors, FSDP1's flat shards; on FSDP2 the parameters are DTensors and
        the bridge refuses its first step (see :data:`KERNEL_OPTIMIZER`)."""
        if self.planning or self.dispatch.wraps_fsdp1 is None or not self.stmt_stack:
            return
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if code_of(node.func).rsplit(".", 1)[-1] == "multi_tensor_applier":
            # a hand-copied apex optimizer's step (in a file that may import nothing of FSDP1's)
            self.fsdp1_elsewhere = True
            self._record(node, "multi_tensor_applier(...) (apex's multi-tensor kernels)", MULTI_TENSOR_KERNEL, False)
            return
        apex = any(n.startswith("apex.optimizers.") for n in names)
        if not (apex or any(n.startswith("bitsandbytes.optim.") for n in names)) or not node.args:
            return
        params = node.args[0].value  # model.parameters() of a model shown to be FSDP1's here
        if not (
            isinstance(params, cst.Call)
            and isinstance(params.func, cst.Attribute)
            and params.func.attr.value in ("parameters", "named_parameters")
            and self._shown_fsdp1(node, params.func.value)
        ):
            return
        self.fsdp1_elsewhere = True  # the TODO goes into a file that may import nothing of FSDP1's
        self._record(
            node, f"{short(code_of(node.func), 40)}(...)", MULTI_TENSOR_KERNEL if apex else KERNEL_OPTIMIZER, False
        )

    def _note_data_swap(self, node: cst.Call) -> None:
        """``upcast(model.parameters(), ...)`` where ``upcast`` is a function of the tree that assigns each
        parameter's ``.data`` (a hand-made fp32 master copy swapped in around ``optimizer.step()``) and ``model`` is
        shown to be FSDP1's: a TODO. FSDP1's flat parameters are plain tensors; FSDP2's are DTensors, whose
        ``.data`` assignment does not reach the local shard the optimizer updates (its dtype and storage stay)."""
        if self.planning or not self.dispatch.data_swappers or not node.args or not self.stmt_stack:
            return
        name = code_of(node.func).rsplit(".", 1)[-1]
        params = node.args[0].value
        if not (
            name in self.dispatch.data_swappers
            and isinstance(params, cst.Call)
            and isinstance(params.func, cst.Attribute)
            and params.func.attr.value in ("parameters", "named_parameters")
            and self._shown_fsdp1(node, params.func.value)
        ):
            return
        self._record(
            node,
            f"{short(code_of(node.func), 40)}({short(code_of(params), 30)}, ...)",
            f"not rewritten: {name} assigns each parameter's .data (a tensor swapped in behind it); FSDP1's flat "
            "parameters are plain tensors, FSDP2's are DTensors, whose .data assignment leaves the local shard the "
            "optimizer updates as it was (its dtype and storage), so the step fails or updates the wrong tensor. "
            "Keep the parameters in the precision the optimizer needs and let FSDP2 cast for compute "
            "(fsdp_bridge.BridgeConfig(mixed_precision={'param_dtype': torch.bfloat16, 'reduce_dtype': "
            "torch.float32}), FSDP2's MixedPrecisionPolicy), or swap the local shards (p.to_local()) instead",
            False,
        )

    def _wrap_meshes(self, model: cst.BaseExpression) -> set[tuple[str, str]] | None:
        """How the file's ``model = FSDP(...)`` calls for ``model`` lay it out: (the strategy's mesh shape, the
        group's source) for each; None where one of them hides its arguments (``**kwargs``)."""
        assert self.module is not None
        target = code_of(model)
        found: set[tuple[str, str]] = set()
        for node in walk(self.module):
            if not (
                isinstance(node, cst.Assign)
                and isinstance(node.value, cst.Call)
                and any(code_of(t.target) == target for t in node.targets)
                and self._qn(node.value.func) == (FSDP, "")
            ):
                continue
            args = named_args(node.value, ("module", "process_group", "sharding_strategy"))
            if args is None:
                return None
            strategy = code_of(args["sharding_strategy"]) if "sharding_strategy" in args else "FULL_SHARD"
            member = strategy.rsplit(".", 1)[-1]
            shape = (
                "1-D"
                if member in ("FULL_SHARD", "SHARD_GRAD_OP")
                else "2-D"
                if member in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")
                else f"sharding_strategy={strategy}"
            )
            group = args.get("process_group", args.get("device_mesh"))
            found.add((shape, "" if group is None else code_of(group)))
        return found

    def _note_paired_meshes(self, node: cst.Call) -> None:
        """``ema.update_average(model, model_ema)`` where ``update_average`` is a function of the tree that zips
        the two models' parameters and this file wraps them with FSDP1 over different groups or strategies (an EMA
        copy over the shard group of a hybrid model): a TODO. FSDP1's flat shards of the two still lined up; on
        FSDP2 their DTensors sit on different meshes, and an operation between them raises."""
        if self.planning or not self.dispatch.param_pairers or self.module is None or not self.stmt_stack:
            return
        name = code_of(node.func).rsplit(".", 1)[-1]
        positional = [a.value for a in node.args if a.keyword is None and not a.star]
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        for pair in sorted(self.dispatch.param_pairers.get(name, ())):
            models = [positional[i] if i < len(positional) else keywords.get(kw) for i, kw in pair]
            first, second = models
            if first is None or second is None:
                continue
            if not (self._shown_fsdp1(node, first) and self._shown_fsdp1(node, second)):
                continue
            one, other = self._wrap_meshes(first), self._wrap_meshes(second)
            if not one or not other or one == other:
                continue

            def said(layouts: set[tuple[str, str]]) -> str:
                return " or ".join(
                    f"{shape}{f' over process_group={short(group, 40)}' if group else ''}"
                    for shape, group in sorted(layouts)
                )

            a, b = short(code_of(first), 30), short(code_of(second), 30)
            self._record(
                node,
                f"{short(code_of(node.func), 40)}({a}, {b}, ...) (the parameters of two FSDP1 models paired)",
                f"not rewritten: {name} pairs the parameters of {a} and {b} element for element, and this file "
                f"wraps them differently ({a}: {said(one)}; {b}: {said(other)}). FSDP1's flat shards of the two "
                "still lined up; on FSDP2 each parameter is a DTensor on its own model's mesh (a 2-D (replicate, "
                "shard) mesh under a hybrid strategy, a 1-D one over a single group), and an operation between "
                "DTensors of different meshes raises. Shard both over one mesh, or pair their local shards "
                "(p.to_local(): the same elements where both shard over the same group)",
                False,
            )
            return

    def _plan_optim_state_call(self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None) -> bool:
        """FSDP1's optimizer-state functions; True when the call is planned."""
        planned = self._plan_optim_state(node, hit)
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if (
            planned
            and hit == (FSDP, "optim_state_dict_to_load")
            and id(node) in self.call_rewrites
            and isinstance(stmt, cst.SimpleStatementLine)
            and any(isinstance(small, cst.Expr) and small.value is node for small in stmt.body)
            # FSDP1 loads into the optimizer itself only with load_directly=True
            and not any(
                a.keyword is not None and a.keyword.value == "load_directly" and code_of(a.value) == "True"
                for a in node.args
            )
        ):
            # FSDP1's call only converts: its result dropped, the optimizer was never loaded here
            construct = "FSDP.optim_state_dict_to_load(...) (its result unused)"
            text = (
                "FSDP1's call returns the state to load and this code drops it, so FSDP1 loaded nothing into the "
                "optimizer here (it loads only with load_directly=True); the rewritten call loads it into the "
                "optimizer: keep it if loading was meant, or delete the statement to keep FSDP1's behaviour"
            )
            self._record(node, construct, text, False)  # a TODO above the statement, beside the rewrite
        return planned

    def _plan_optim_state(self, node: cst.Call, hit: tuple[str, str] | None) -> bool:
        """``_plan_optim_state_call`` itself."""
        if hit is not None and hit[0] == FSDP and (why := self._optim_call_not_rewritten(node, hit[1])) is not None:
            self._record(node, f"FSDP.{hit[1]}(...)", f"not rewritten: {why}", False)
            self._consume(node.func)
            return True
        if hit == (FSDP, "optim_state_dict_to_load") and self._load_type_set_elsewhere(node):
            return True
        sharded = self.dispatch.sets_state_dict_type is not None and self.dispatch.unfollowed_set_state_dict_type
        if (
            hit == (FSDP, "optim_state_dict_to_load")
            and (code := self._optim_to_load(node, self._options(False) if sharded else None)) is not None
        ):
            self.call_rewrites[id(node)] = code
            self._record(
                node,
                "FSDP.optim_state_dict_to_load(...)",
                f"{code}: loads the state into the optimizer "
                "(torch's set_optimizer_state_dict) and returns optimizer.state_dict(), so loading the "
                "result again changes nothing" + _OLD_ORDER * self._old_argument_order(node),
                True,
            )
            return True
        if (
            hit in ((FSDP, "shard_full_optim_state_dict"), (FSDP, "scatter_full_optim_state_dict"))
            and (code := self._shard_full_to_load(node)) is not None
        ):
            self.call_rewrites[id(node)] = code
            self._record(
                node,
                f"FSDP.{hit[1]}(...)",
                f"{code}: loads the full state into the optimizer (torch's set_optimizer_state_dict, "
                "full_state_dict=True"
                + (", rank 0's sent to the others" if hit[1].startswith("scatter") else "")
                + ") and returns optimizer.state_dict(), so loading the result changes nothing",
                True,
            )
            return True
        if hit in ((FSDP, "shard_full_optim_state_dict"), (FSDP, "scatter_full_optim_state_dict")) and (
            (stmt := self._result_never_read(node)) is not None
        ):
            self.removed_stmts.add(id(stmt))
            self._consume(node.func)
            self._record(
                node,
                f"FSDP.{hit[1]}(...) (its result never read)",
                "deleted: FSDP1's call only returns the optimizer state to load (into no optimizer here: nothing "
                "reads its result), so it loaded nothing on FSDP1 and the code without it does what it did; to load "
                "a full optimizer state on FSDP2, fsdp_bridge.optim_state_dict_to_load(model, optimizer, full_osd"
                + (
                    ", options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))"
                    if hit[1].startswith("scatter")
                    else ")"
                )
                + " loads it into the optimizer",
                True,
            )
            return True
        if hit == (FSDP, "optim_state_dict") and (ctx := self._runtime_state_context()) is not None:
            if (where := self.dispatch.makes_state_dict_context) is not None and (
                mo := self._model_and_own_optim_state(node)
            ) is not None:
                code = f"fsdp_bridge.optim_state_dict({mo[0]}, {mo[1]})"
                self.call_rewrites[id(node)] = code
                self.needs_imports.add(("fsdp_bridge", None))
                self._consume(node.func)
                owner = self._subclass_context(ctx)
                self._record(
                    node,
                    "FSDP.optim_state_dict(...)",
                    f"{code}: inside `with {short(ctx)}:` ({where} makes FSDP1's state-dict contexts, rewritten to "
                    "fsdp_bridge.state_dict_type): FSDP1's own call on FSDP1 models, on FSDP2 torch's "
                    "get_optimizer_state_dict with that block's type"
                    if owner is None
                    else f"{code}: inside `with {short(ctx)}:`, FSDP1's own context ({owner} subclasses FSDP1's "
                    "wrapper and stays FSDP1's, with the models it makes): FSDP1's own call on FSDP1 models, which "
                    "follows that block's type",
                    True,
                )
                return True
            self._record(
                node,
                "FSDP.optim_state_dict(...)",
                f"not rewritten: it runs inside `with {short(ctx)}:`, a context made elsewhere that may set "
                "FSDP1's state-dict type, and FSDP1's optim_state_dict is sharded under SHARDED_STATE_DICT "
                "and full otherwise: use get_optimizer_state_dict(model, optim) for sharded, with "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True) for full",
                False,
            )
            self._consume(node.func)
            return True
        if (
            hit is not None
            and hit[0] == FSDP
            and hit[1] in ("optim_state_dict", "full_optim_state_dict", "sharded_optim_state_dict")
        ):
            if self._plan_optim_call(node, hit[1]):
                return True
        return False

    def _optim_call_not_rewritten(self, node: cst.Call, member: str) -> str | None:
        """Why an optimizer-state call that names a non-default process group or optimizer state is left
        as it is (None for any other call: the reference pass reports it)."""
        orders: dict[str, tuple[str, ...]] = {  # FSDP1's signatures
            "optim_state_dict": ("model", "optim", "optim_state_dict", "group"),
            "optim_state_dict_to_load": (
                "model",
                "optim",
                "optim_state_dict",
                "is_named_optimizer",
                "load_directly",
                "group",
            ),
            "full_optim_state_dict": ("model", "optim", "optim_input", "rank0_only", "group"),
            "scatter_full_optim_state_dict": ("full_optim_state_dict", "model", "optim_input", "optim", "group"),
        }
        order = orders.get(member)
        if order is None:
            return None
        named = named_args(node, order)
        if named is None:
            return None
        group = named.get("group")
        if group is not None and not m.matches(group, m.Name("None")):
            return (
                f"group={short(code_of(group), 30)} is a process group of its own; torch's "
                "get_optimizer_state_dict / set_optimizer_state_dict work over the model's own mesh (FSDP2) or "
                "process group (FSDP1): drop group= where it is the group the model is sharded over"
            )
        optim = named.get("optim")
        if optim is not None and self._named_optimizer(code_of(optim)):
            return (
                f"{short(code_of(optim), 30)} is a keyed optimizer (is_named_optimizer=True): its state is keyed "
                "by parameter name, which FSDP1's functions keep and torch's get_optimizer_state_dict / "
                f"set_optimizer_state_dict renumber; on FSDP2 save and load it with {short(code_of(optim), 30)}"
                ".state_dict() / .load_state_dict(...) (names kept, DTensor values DCP saves and loads in place)"
            )
        given = named.get("optim_state_dict")
        if (
            member == "optim_state_dict"
            and given is not None
            and not m.matches(given, m.Name("None"))
            and self._model_and_own_optim_state(node) is None  # optim.state_dict(), inline or just above: the default
        ):
            block = next(
                (
                    code_of(s.items[0].item.args[1].value)
                    for s in reversed(self.stmt_stack)
                    if isinstance(s, cst.With)
                    and isinstance(s.items[0].item, cst.Call)
                    and code_of(s.items[0].item.func).endswith(".state_dict_type")  # FSDP's, or a first --fix's
                    and len(s.items[0].item.args) > 1
                ),
                None,
            )
            where = f" (inside a state_dict_type block of {short(block, 40)})" if block else ""
            return (
                f"optim_state_dict={short(code_of(given), 30)}{where} is not shown to be "
                f"{short(code_of(named.get('optim', given)), 30)}.state_dict() taken by the statement just above "
                "(FSDP1's default for it); torch's get_optimizer_state_dict reads the optimizer's own state: if "
                "it is that, drop the argument; if it is another state, load it into the optimizer first"
            )
        return None

    def _named_optimizer(self, optim: str) -> bool:
        """The enclosing function (or module) passes ``optim`` to an FSDP1 optimizer-state call with
        ``is_named_optimizer=True``: its state is keyed by names (torchrec's KeyedOptimizer)."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        for n in walk(scope) if scope is not None else ():
            if not isinstance(n, cst.Call) or self._qn(n.func) != (FSDP, "optim_state_dict_to_load"):
                continue
            named = named_args(n, ("model", "optim", "optim_state_dict", "is_named_optimizer"))
            flag = named.get("is_named_optimizer") if named is not None else None
            if named is not None and code_of(named.get("optim", n)) == optim and flag is not None:
                if not m.matches(flag, m.Name("False")):
                    return True
        return False

    def _plan_optimizer_order(self, body: Sequence[cst.BaseStatement]) -> None:
        """``opt = torch.optim.X(M.parameters(), ...)`` before ``M = FSDP(M, ...)`` in the same block moves
        to just after it: FSDP2 replaces the parameters, so an optimizer built before would update
        tensors the model no longer uses (training silently nothing)."""
        wraps: dict[str, int] = {}
        for i, stmt in enumerate(body):
            target = assign_target(stmt)
            if (
                target is not None
                and isinstance(value := assign_value(stmt), cst.Call)
                and self._qn(value.func) == (FSDP, "")
                and value.args
                and code_of(value.args[0].value) == target
            ):
                wraps.setdefault(target, i)
        for i, stmt in enumerate(body):
            value = assign_value(stmt)
            if not isinstance(value, cst.Call):
                continue
            names = {q.name for q in self.get_metadata(QualifiedNameProvider, value.func, set())}
            text = code_of(value)
            if not any(n.startswith("torch.optim.") for n in names):
                self._note_optimizer_built_by_model(body, i, stmt, value)
                continue
            uses = {t for t in wraps if f"{t}.parameters()" in text or f"{t}.named_parameters()" in text}
            for target in uses:
                j = wraps[target]
                if i < j and not any(assign_target(body[k]) == assign_target(stmt) for k in range(i + 1, j)):
                    followers = _followers(body, i, j, target)
                    if followers is None:
                        construct = f"{code_of(value.func)}(...) before FSDP(...)"
                        note = (
                            f"not rewritten: FSDP2 replaces {target}'s parameters, so an optimizer built before the "
                            "wrap would update tensors the model no longer uses; the statements between them use "
                            "the optimizer (a scheduler, ...) in a way that cannot move with it: build the optimizer "
                            "and what uses it after the wrap"
                        )
                        pos = self.get_metadata(PositionProvider, stmt).start
                        self.findings.append(CodeFinding(self.path, pos.line, pos.column, construct, note, False))
                        self.todos.setdefault(id(stmt), []).append(f"{construct}: {note}")
                        continue
                    for k in (i, *followers):
                        self.optimizer_moves[id(body[k])] = id(body[j])
                    also = [short(code_of(assign_value(body[k]) or body[k]), 40) for k in followers]
                    self._record(
                        stmt,
                        f"{code_of(value.func)}(...) before FSDP(...)",
                        f"moved after the shard call: FSDP2 replaces {target}'s parameters, and an optimizer "
                        "built before would update tensors the model no longer uses"
                        + (f" (with what uses it there: {', '.join(also)})" if also else ""),
                        True,
                    )
            self._note_optimizer_before_nested_wrap(body, i, stmt, text)

    def _note_optimizer_built_by_model(
        self, body: Sequence[cst.BaseStatement], i: int, stmt: cst.BaseStatement, value: cst.Call
    ) -> None:
        """``optimizer = model.configure_optimizers(...)`` (or ``build_optimizer(model, ...)``: a name holding
        ``optim`` assigned a call of the model's method, or one handed the model) before ``model = FSDP(model,
        ...)`` later in the block or on a branch of it: a TODO (the call builds the optimizer from the parameters
        the wrap replaces; it is the tree's own function, so it is not moved)."""
        name = assign_target(stmt)
        if name is None or "optim" not in name.lower():
            return
        func = value.func
        handed = {code_of(a.value) for a in value.args if a.keyword is None and not a.star}
        owner = code_of(func.value) if isinstance(func, cst.Attribute) else None
        for later in body[i + 1 :]:
            for n in walk(later):
                target, wrap = assign_target(n), assign_value(n)
                if not (
                    target is not None
                    and isinstance(wrap, cst.Call)
                    and self._qn(wrap.func) == (FSDP, "")
                    and wrap.args
                    and code_of(wrap.args[0].value) == target
                    and (owner == target or target in handed)
                ):
                    continue
                pos = self.get_metadata(PositionProvider, stmt)
                construct = f"{short(code_of(value), 40)} before FSDP({target}, ...)"
                note = (
                    f"this optimizer is built from {target}'s parameters before the wrap "
                    f"`{short(code_of(n), 50)}` (line {self.get_metadata(PositionProvider, n).start.line} before "
                    "--fix); FSDP2 replaces them (so does FSDP1 "
                    "without use_orig_params=True), and it would update tensors the model no longer uses (the bridge "
                    "refuses it at the first step): build it after the wrap, on every branch"
                )
                self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, construct, note, False))
                self.todos.setdefault(id(stmt), []).append(f"{construct}: {note}")
                return

    def _note_optimizer_before_nested_wrap(
        self, body: Sequence[cst.BaseStatement], i: int, stmt: cst.BaseStatement, text: str
    ) -> None:
        """An optimizer over ``M.parameters()`` built before ``M = FSDP(M, ...)`` that a later statement of the
        block holds on one branch only (``if use_fsdp: model = FSDP(model)``): it cannot move there (the other
        branch uses it too), so a TODO. FSDP2 gives the model new parameter objects (FSDP1 does too without
        ``use_orig_params=True``), and the optimizer would update the old ones."""
        if id(stmt) in self.optimizer_moves:
            return
        for later in body[i + 1 :]:
            if not isinstance(later, (cst.If, cst.Try, cst.With)):
                continue
            for n in walk(later):
                target, value = assign_target(n), assign_value(n)
                if (
                    target is not None
                    and isinstance(value, cst.Call)
                    and self._qn(value.func) == (FSDP, "")
                    and value.args
                    and code_of(value.args[0].value) == target
                    and (f"{target}.parameters()" in text or f"{target}.named_parameters()" in text)
                ):
                    pos = self.get_metadata(PositionProvider, stmt)
                    construct = f"{short(text, 40)} before FSDP({target}, ...) on a branch"
                    note = (
                        f"this optimizer holds {target}'s parameters from before the wrap "
                        f"`{short(code_of(n), 50)}` (line {self.get_metadata(PositionProvider, n).start.line} "
                        "before --fix); FSDP2 replaces them (so does FSDP1 "
                        "without use_orig_params=True), and it would update tensors the model no longer uses (the "
                        "bridge refuses it at the first step): build it after the wrap, on every branch"
                    )
                    self.findings.append(
                        CodeFinding(self.path, pos.start.line, pos.start.column, construct, note, False)
                    )
                    self.todos.setdefault(id(stmt), []).append(f"{construct}: {note}")
                    return

    def _plan_optim_call(self, node: cst.Call, member: str) -> bool:
        """FSDP's optimizer-state functions outside a state_dict_type block -> torch's state_dict API."""
        params = (
            ("model", "optim", "optim_input", "rank0_only", "group")
            if member == "full_optim_state_dict"
            else ("model", "optim", "optim_state_dict", "group")
        )
        if member == "optim_state_dict" and self._plan_optim_state_with_kwargs(node):
            return True
        named = named_args(node, params)
        code = None
        unused = ("optim_input", "optim_state_dict", "group")
        if (
            named is not None
            and "model" in named
            and "optim" in named
            and all(
                m.matches(named[k], m.Name("None"))
                # optim.state_dict(), inline or taken just above: FSDP1's default for it
                or (k == "optim_state_dict" and self._model_and_own_optim_state(node) is not None)
                for k in unused
                if k in named
            )
        ):
            model = code_of(named["model"])
            # FSDP.optim_state_dict follows the model's persistent state-dict type (FSDP.set_state_dict_type);
            # FULL_STATE_DICT: made in this function and never set since, FSDP1's default, written below.
            where = self.dispatch.sets_state_dict_type if member == "optim_state_dict" else None
            persistent = self._persistent_type(node, model) if where is not None else None
            if where is not None and persistent != "FULL_STATE_DICT":
                if persistent == "SHARDED_STATE_DICT":
                    self.needs_state_dict_api.add("get_optimizer_state_dict")
                    offload = self._persistent_optim_offload(node, model)
                    options = self._options(False, offload=offload)
                    code = f"get_optimizer_state_dict({model}, {code_of(named['optim'])}, options={options})"
                    self.call_rewrites[id(node)] = code
                    self._record(
                        node,
                        f"FSDP.{member}(...)",
                        f"{code}: FSDP.set_state_dict_type({short(model, 30)}, SHARDED_STATE_DICT) above makes "
                        "FSDP1's optimizer state of this model sharded from then on"
                        + (
                            ", on the CPU (ShardedOptimStateDictConfig's default offload_to_cpu=True)"
                            if offload
                            else ""
                        ),
                        True,
                    )
                    return True
                if self.dispatch.unfollowed_set_state_dict_type is None:
                    # every set_state_dict_type of the tree becomes fsdp_bridge's, which this call follows
                    self.needs_imports.add(("fsdp_bridge", None))
                    code = f"fsdp_bridge.optim_state_dict({model}, {code_of(named['optim'])})"
                    self.call_rewrites[id(node)] = code
                    self._consume(node.func)
                    self._record(
                        node,
                        f"FSDP.{member}(...)",
                        f"{code}: {where} calls FSDP.set_state_dict_type, rewritten to fsdp_bridge's; the type "
                        "follows fsdp_bridge.set_state_dict_type at run time (FSDP1's own call on FSDP1 "
                        "models; on FSDP2 the type set, else FSDP1's default FULL_STATE_DICT; LOCAL_STATE_DICT "
                        "refused on FSDP2)",
                        True,
                    )
                    return True
                self._record(
                    node,
                    f"FSDP.{member}(...)",
                    f"not rewritten: {where} calls FSDP.set_state_dict_type, so this optimizer state's type (full "
                    "or sharded) is set at run time; FSDP2 has no such setting: use get_optimizer_state_dict(model, "
                    "optim) for sharded, with options=StateDictOptions(full_state_dict=True) for full",
                    False,
                )
                self._consume(node.func)
                return True
            rank0 = named.get("rank0_only")
            model, optim = code_of(named["model"]), code_of(named["optim"])
            if member == "full_optim_state_dict":
                # FSDP1's full state: a CPU copy on rank 0 (each group's first rank over process groups), or on
                # every rank with rank0_only=False, gathered one tensor at a time; it takes a trainer's optimizer
                # wrapper as FSDP1 does (torch's get_optimizer_state_dict needs the optimizer itself)
                self.needs_imports.add(("fsdp_bridge", None))
                extra = "" if rank0 is None else f", rank0_only={code_of(rank0)}"
                code = f"fsdp_bridge.full_optim_state_dict({model}, {optim}{extra})"
                self.call_rewrites[id(node)] = code
                why = GROUP_RANK0 if self.dispatch.group_fsdp is not None else FULL_OPTIM_TEXT
                self._record(node, f"FSDP.{member}(...)", f"{code}: {why}", True)
                return True
            if member == "optim_state_dict":
                self.needs_imports.add(("fsdp_bridge", None))
                self._consume(node.func)
                if where is not None and self.dispatch.unfollowed_set_state_dict_type is None:
                    # FULL_STATE_DICT set above, with configs known at run time: the bridge follows them
                    code = f"fsdp_bridge.optim_state_dict({model}, {optim})"
                    why = (
                        f"{where} calls FSDP.set_state_dict_type, rewritten to fsdp_bridge's, and this model's type is "
                        "FULL_STATE_DICT here; the bridge's call follows the optimizer config set with it (FSDP1's "
                        "default FullOptimStateDictConfig(): a CPU copy on every rank)"
                    )
                else:
                    # FSDP1's default type and optimizer config: FullOptimStateDictConfig(), a CPU copy on every rank
                    code = f"fsdp_bridge.full_optim_state_dict({model}, {optim}, rank0_only=False, offload_to_cpu=True)"
                    why = (
                        "FSDP1's default state-dict type and optimizer config (FullOptimStateDictConfig()): the full "
                        "state as a CPU copy on every rank, gathered one tensor at a time (torch's "
                        "StateDictOptions(full_state_dict=True) would put the whole state on every GPU)"
                    )
                self.call_rewrites[id(node)] = code
                self._record(node, f"FSDP.{member}(...)", f"{code}: {why}", True)
                return True
            self.needs_state_dict_api.add("get_optimizer_state_dict")
            # FSDP.sharded_optim_state_dict offloads its shards to the CPU (FSDP1 calls its implementation with
            # cpu_offload=True)
            code = f"get_optimizer_state_dict({model}, {optim}, options={self._options(False, offload=True)})"
        if code is None:
            return False
        self.call_rewrites[id(node)] = code
        self._record(node, f"FSDP.{member}(...)", code, True)
        return True

    def _plan_optim_state_with_kwargs(self, node: cst.Call) -> bool:
        """``FSDP.optim_state_dict(model, optim, **kwargs)``: what ``kwargs`` holds is known only when the code
        runs (FSDP1's ``optim_state_dict=`` / ``group=``, or a keyword a feature test adds), so the call goes to
        ``fsdp_bridge.optim_state_dict``, which keeps FSDP1's whole signature: FSDP1's own call on FSDP1 models,
        on FSDP2 the type in force (FSDP1's default full state outside any) and a clear error for a value FSDP2
        cannot honour. Left to the reference pass (a TODO) where the tree sets a state-dict type the bridge does
        not follow."""
        stars = [a for a in node.args if a.star]
        if len(stars) != 1 or stars[0].star != "**" or node.args[-1] is not stars[0]:
            return False
        named = named_args(node.with_changes(args=node.args[:-1]), ("model", "optim"))
        if named is None or set(named) != {"model", "optim"}:
            return False
        if self.dispatch.sets_state_dict_type is not None and self.dispatch.unfollowed_set_state_dict_type is not None:
            return False
        model, optim, kwargs = code_of(named["model"]), code_of(named["optim"]), code_of(stars[0].value)
        code = f"fsdp_bridge.optim_state_dict({model}, {optim}, **{kwargs})"
        self.call_rewrites[id(node)] = code
        self.needs_imports.add(("fsdp_bridge", None))
        self._consume(node.func)
        self._record(
            node,
            "FSDP.optim_state_dict(...)",
            f"{code}: the arguments in {short(kwargs, 30)} are known only when the code runs, and "
            "fsdp_bridge.optim_state_dict takes FSDP1's (optim_state_dict=None, group=None; another keyword is "
            "a TypeError as on FSDP1): FSDP1's own call on FSDP1 models; on FSDP2 the state-dict type in force "
            "(FSDP1's default outside any: the full state as a CPU copy on every rank), and a clear error before "
            "any collective for optim_state_dict= or a group other than the model's",
            True,
        )
        return True

    def _old_argument_order(self, node: cst.Call) -> bool:
        """``FSDP.optim_state_dict_to_load`` written with torch < 2.1's order, ``(optim_state_dict, model, optim)``:
        in the branch the code takes on old torch (dead on the torch versions FSDP2 needs), its third positional
        argument named as an optimizer and the first two not (in today's order the third is the state dict), or
        its second shown to be FSDP1's model and its first not (in today's order the second is the optimizer).
        Either way the rewrite reads the arguments in that order, as the code meant them."""
        positional = [a.value for a in node.args if a.keyword is None]
        if not positional:
            return False
        if self._in_old_torch_branch(node):
            return True
        if len(positional) >= 3 and [_optimizer_named(code_of(p)) for p in positional[:3]] == [False, False, True]:
            return True  # (osd, model, optimizer): today's order ends with the state dict, not an optimizer
        return (
            len(positional) >= 2
            and self._fsdp1_wrapper(node, positional[1], by_calls=False) != ""
            and self._fsdp1_wrapper(node, positional[0], by_calls=False) == ""
        )

    def _in_old_torch_branch(self, node: cst.CSTNode) -> bool:
        """Inside the branch of ``if <torch.__version__> < ...:`` (or the else of ``>=``) taken on old torch."""
        line = self.get_metadata(PositionProvider, node).start.line
        for stmt in self.stmt_stack:
            if not isinstance(stmt, cst.If) or "torch.__version__" not in (test := code_of(stmt.test)):
                continue
            in_body = line <= self.get_metadata(PositionProvider, stmt.body).end.line
            if in_body == ("<" in test):
                return True
        return False

    def _load_type_set_elsewhere(self, node: cst.Call) -> bool:
        """``FSDP.optim_state_dict_to_load(M, O, sd)`` in a tree whose ``FSDP.set_state_dict_type`` calls are
        not all rewritten to fsdp_bridge's: FSDP1 reads ``sd`` as full or sharded by the type set at run time,
        so unless a SHARDED set of ``M`` just above shows it, the call stays with a TODO (True: recorded)."""
        where = self.dispatch.sets_state_dict_type
        if where is None or self.dispatch.unfollowed_set_state_dict_type is None:
            return False
        named = named_args(node, ("model", "optim", "optim_state_dict"))
        model = code_of(named["model"]) if named is not None and "model" in named else None
        if model is not None and self._persistent_type(node, model) == "SHARDED_STATE_DICT":
            return False
        self._record(
            node,
            "FSDP.optim_state_dict_to_load(...)",
            f"not rewritten: {where} calls FSDP.set_state_dict_type, so whether this optimizer state is full or "
            "sharded is set at run time; FSDP2 has no such setting: load it with set_optimizer_state_dict(model, "
            "optim, sd), with options=StateDictOptions(full_state_dict=True) for a full one",
            False,
        )
        self._consume(node.func)
        return True

    def _optim_to_load(self, node: cst.Call, options: str | None) -> str | None:
        """``FSDP.optim_state_dict_to_load(M, O, sd)`` kept in a variable -> fsdp_bridge's helper that loads
        it and returns ``O.state_dict()`` (a later ``O.load_state_dict(x)`` then changes nothing)."""
        order: tuple[str, ...] = ("model", "optim", "optim_state_dict", "is_named_optimizer", "load_directly", "group")
        if self._old_argument_order(node):
            order = ("optim_state_dict", "model", "optim")
        named = named_args(node, order)
        if named is None or not {"model", "optim", "optim_state_dict"} <= set(named):
            return None
        if set(named) - {"model", "optim", "optim_state_dict", "load_directly"}:
            return None
        self.needs_imports.add(("fsdp_bridge", None))
        self._consume(node.func)
        extra = f", options={options}" if options else ""
        return (
            f"fsdp_bridge.optim_state_dict_to_load({code_of(named['model'])}, {code_of(named['optim'])}, "
            f"{code_of(named['optim_state_dict'])}{extra})"
        )

    def _result_never_read(self, node: cst.Call) -> cst.SimpleStatementLine | None:
        """The statement ``x = <node>`` (or ``<node>`` alone) whose result nothing in the function reads, whose
        arguments are names, attributes or constants (nothing else runs in them): it can go. None otherwise."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1 or not self.functions:
            return None
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and small.value is node and len(small.targets) == 1:
            target = small.targets[0].target
            if not isinstance(target, cst.Name) or not self._names_stay_in([stmt], {target.value}):
                return None
        elif not (isinstance(small, cst.Expr) and small.value is node):
            return None
        if not all(isinstance(a.value, (cst.Name, cst.Attribute, cst.SimpleString, cst.Integer)) for a in node.args):
            return None
        return stmt

    def _shard_full_to_load(self, node: cst.Call) -> str | None:
        """``x = FSDP.shard_full_optim_state_dict(sd, M, optim=O)`` (loaded later) -> the helper that
        loads it into ``O`` and returns ``O.state_dict()``; without ``optim`` the optimizer is unknown."""
        scatter = self._qn(node.func) == (FSDP, "scatter_full_optim_state_dict")
        named = named_args(node, ("full_optim_state_dict", "model", "optim_input", "optim", "group"))
        if named is None or not {"full_optim_state_dict", "model"} <= set(named):
            return None
        if "group" in named and not m.matches(named["group"], m.Name("None")):
            return None  # a process group of its own: torch's calls take the model's mesh (a TODO)
        if "optim_input" in named and not m.matches(named["optim_input"], m.Name("None")):
            return None
        optim = code_of(named["optim"]) if "optim" in named else self._loaded_into(node)
        if optim is None:
            return None
        self.needs_imports.add(("fsdp_bridge", None))
        self._consume(node.func)
        # scatter: rank 0's full state is sent to the others (theirs may be None), as FSDP1 does.
        options = f", options={self._options(True, broadcast=True)}" if scatter else ""
        return (
            f"fsdp_bridge.optim_state_dict_to_load({code_of(named['model'])}, {optim}, "
            f"{code_of(named['full_optim_state_dict'])}{options})"
        )

    def _loaded_into(self, node: cst.Call) -> str | None:
        """``x = <node>`` with ``O.load_state_dict(x)`` later in the same function: ``O``, the one optimizer."""
        if not self.stmt_stack or not self.functions:
            return None
        stmt = self.stmt_stack[-1]
        target = assign_target(stmt)
        if target is None or assign_value(stmt) is not node:
            return None
        function = self.functions[-1]
        nested = [n for n in walk(function.body) if isinstance(n, (cst.FunctionDef, cst.Lambda))]
        inner = {id(x) for n in nested for x in walk(n)}
        line = self.get_metadata(PositionProvider, stmt).start.line
        optims = {
            code_of(n.func.value)
            for n in walk(function.body)
            if id(n) not in inner
            and isinstance(n, cst.Call)
            and isinstance(n.func, cst.Attribute)
            and n.func.attr.value == "load_state_dict"
            and len(n.args) == 1
            and code_of(n.args[0].value) == target
        }
        if len(optims) != 1:
            return None
        optim = optims.pop()
        # It must exist when the call runs: a parameter of the function, or assigned above the call.
        params = {p.name.value for p in (*function.params.params, *function.params.kwonly_params)}
        root = optim.split(".")[0]
        assigned_before = any(
            isinstance(n, cst.Assign)
            and id(n) not in inner
            and any(code_of(t.target) in (optim, root) for t in n.targets)
            and self.get_metadata(PositionProvider, n).start.line < line
            for n in walk(function.body)
        )
        return optim if root in params or assigned_before else None

    def _plan_optim_load(self, node: cst.Call) -> bool:
        """``O.load_state_dict(FSDP.optim_state_dict_to_load|shard_full_optim_state_dict|
        scatter_full_optim_state_dict(...))`` -> ``set_optimizer_state_dict(M, O, sd, options=...)``."""
        func = node.func
        if not (
            isinstance(func, cst.Attribute)
            and func.attr.value == "load_state_dict"
            and len(node.args) == 1
            and isinstance(node.args[0].value, cst.Call)
        ):
            return False
        inner = node.args[0].value
        hit = self._qn(inner.func)
        if hit is None or hit[0] != FSDP:
            return False
        optim = code_of(func.value)
        args = [code_of(a.value) for a in inner.args if a.keyword is None]
        keywords = {a.keyword.value: code_of(a.value) for a in inner.args if a.keyword is not None}
        if (
            hit[1] == "optim_state_dict_to_load"
            and self.dispatch.sets_state_dict_type is not None
            and self.dispatch.unfollowed_set_state_dict_type is None
        ):
            return False  # the inner call becomes fsdp_bridge's, which follows the type set at run time
        if hit[1] == "optim_state_dict_to_load" and len(args) >= 3:
            if self._load_type_set_elsewhere(inner):
                return True
            old = self._old_argument_order(inner)  # torch < 2.1: (optim_state_dict, model, optim)
            model: str | None = args[1] if old else args[0]
            sharded = self.dispatch.sets_state_dict_type is not None  # then SHARDED, set just above
            sd, opts = args[0] if old else args[2], self._options(not sharded)
        elif hit[1] in ("shard_full_optim_state_dict", "scatter_full_optim_state_dict") and args:
            model = args[1] if len(args) > 1 else keywords.get("model")
            sd = args[0]
            opts = self._options(True, broadcast=hit[1] == "scatter_full_optim_state_dict")
            if model is None:
                return False
        else:
            return False
        self.needs_state_dict_api.add("set_optimizer_state_dict")
        code = f"set_optimizer_state_dict({model}, {optim}, {sd}, options={opts})"
        self.call_rewrites[id(node)] = code
        self._consume(inner)
        old_order = hit[1] == "optim_state_dict_to_load" and self._old_argument_order(inner)
        self._record(node, f"FSDP.{hit[1]}(...)", code + _OLD_ORDER * old_order, True)
        return True


_OLD_ORDER = "; its arguments are in torch < 2.1's order, (optim_state_dict, model, optim), and are read so"

_OPTIMIZER_NAME = re.compile(r"(?:optim|optimizer|opt)\d*")


def _optimizer_named(code: str) -> bool:
    """``code`` is a name (or an attribute, ``self.optimizer``) that names an optimizer, not its state."""
    last = code.rsplit(".", 1)[-1]
    return last.isidentifier() and _OPTIMIZER_NAME.fullmatch(last.lower()) is not None
