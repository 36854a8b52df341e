"""The FSDP1 wrapper's gradient methods: ``model.no_sync()`` and ``model.clip_grad_norm_(...)``
(not DDP's ``no_sync``, not torch's or another library's ``clip_grad_norm_``)."""

from __future__ import annotations

import os
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import CodePosition, PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import (
    called_as,
    code_of,
    handed_parameters,
    names_from,
    short,
    walk,
    wrapper_kinds_named,
)
from fsdp_bridge.migrate._names import FSDP, NAMES
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase
from fsdp_bridge.migrate._torch_helpers import HELPERS_NAME

LOCAL_CLIP = (
    "left as it is; its meaning changes: on FSDP1 (flat parameters) torch's clip_grad_norm_ sees the gradient "
    "shards this rank holds, so each rank clips by the norm of its own shard, while on FSDP2 the parameters are "
    "DTensors and the norm is the whole model's (what FSDP1's own model.clip_grad_norm_ gives): the clipping, "
    "and any norm it returns or logs, change to the global one; the norm it returns is a DTensor there "
    "(.item() and float() work, a format spec such as f'{norm:.3f}' raises TypeError: use norm.full_tensor()). "
    "Parameters left plain beside the DTensors (ignored_modules') make torch's clip raise (mixed torch.Tensor "
    "and DTensor); fsdp_bridge.clip_grad_norm_(model, max_norm) takes both"
)


SHARD_SHAPES = (
    "left as it is; its meaning changes: after FSDP1 wraps the model its parameters are 1-D, this rank's flat "
    "shard or (use_orig_params=True) views into it (ndim 1, numel() this rank's count, 0 where the rank holds "
    "none of it), while on FSDP2 they are DTensors with the full shape (numel() the whole count; p.to_local() is this "
    "rank's shard): a rule on ndim or shape (weight decay for matrices only), or a count of numel(), gives "
    "other results; check it with fsdp-bridge migrate verify"
)
SHAPE_GROUPS = (
    "not rewritten: a rule on each parameter's shape (ndim, dim(), shape, numel()) picks its group here (weight "
    "decay for matrices only); after FSDP1 wraps the model every parameter is 1-D (a flat shard, or with "
    "use_orig_params=True a 1-D view into one), so FSDP1 put them all in one group (no weight decay at all under "
    "a `ndim <= 1` rule), while on FSDP2 they keep their shapes and the rule splits them as written: the training "
    "differs from the FSDP1 run from the first step (the rule as meant, most likely). Keep it so, or give every "
    "parameter FSDP1's group to reproduce the old run; fsdp-bridge migrate verify shows the difference"
)
"""The TODO at a parameter-group split decided by FSDP1 parameters' shapes."""

SUMMED_COUNT = (
    "not rewritten: after FSDP1 wraps the model each rank's parameters are its shard (numel() this rank's count), "
    "so adding the counts of every rank with all_reduce gave the model's size; on FSDP2 they are DTensors whose "
    "numel() is the whole count, and the all_reduce gives the world size times it. Count p.to_local().numel() "
    "to keep the all_reduce (the shards add up to the model's size), or keep numel() and drop the all_reduce"
)
"""The TODO at a count of FSDP1 parameters' numel() that the code then adds across ranks."""

FLAT_NAMES = (
    "left as it is; its meaning changes: with use_orig_params=False (FSDP1's default) the wrapped model's "
    "named_parameters() are its flat parameters (`_flat_param`, one per unit), so a rule on the names (no weight "
    "decay for bias or norm weights, a frozen or a per-layer group) matched none of the model's own names and every "
    "flat parameter took the other branch; on FSDP2 the names are the model's own and the rule applies as written "
    "(with use_orig_params=True FSDP1 gave the model's names with its wrappers' `_fsdp_wrapped_module.` prefixes, "
    "so a marker such as '.layers.' matched there and may match nothing in FSDP2's plain names): the optimizer's "
    "groups change; check it with fsdp-bridge migrate verify"
)
GRAD_COLLECTIVE = (
    "left as it is; if these gradients are an FSDP1 model's, its meaning changes: FSDP1's are plain tensors (this "
    "rank's flat shard), whose local norm this collective sums over the ranks; on FSDP2 they are DTensors, so a "
    "norm or sum of them is a DTensor (already the whole model's), which torch.distributed's collectives refuse "
    "(at run time, at the first step): take torch.nn.utils.clip_grad_norm_ (or get_total_norm) of the parameters, "
    "which gives the global norm on FSDP2, or reduce the local shards' values (p.grad.to_local())"
)
PARAM_COLLECTIVE = (
    "not rewritten: on FSDP1 each rank passes its flat shard here (the whole parameter with NO_SHARD), on FSDP2 "
    "the parameters and their .data and .grad are DTensors, which torch.distributed's collectives refuse "
    "(NotImplementedError at run time): pass p.to_local() (this rank's shard: the same elements on every rank "
    "holding the same shard, as the replicas of a HYBRID mesh or the ranks of NO_SHARD), or p.full_tensor() "
    "(the whole parameter, gathered)"
)
"""The TODO for a torch.distributed collective over an FSDP1 model's parameters (or their data / grads)."""

PARAM_SUM = (
    "not rewritten: this adds up a reduction of each parameter; on FSDP1 a parameter (or its .data / .grad) is this "
    "rank's flat shard, a plain tensor, so the sum was this rank's part only; on FSDP2 it is a DTensor: the "
    "reduction runs a collective and gives the whole parameter's value as a DTensor, which an in-place add into a "
    "plain tensor refuses (a DTensor and a torch.Tensor mixed). Reduce p.to_local() for FSDP1's per-rank value, or "
    "keep the DTensor result (.full_tensor() for a plain one) for the whole model's"
)
"""The TODO for ``total += torch.norm(p.data)`` over an FSDP1 model's parameters."""

_REDUCTIONS = ("norm", "vector_norm", "sum", "mean", "max", "min", "amax", "amin", "square", "pow", "abs")

DUCK_CLIP = (
    "not rewritten: a test for FSDP1's wrapper by its method; a model fsdp_bridge.shard() makes on FSDP2 has no "
    "clip_grad_norm_, so the other branch runs for it, and torch.nn.utils.clip_grad_norm_ over its DTensor "
    "parameters clips by the same global norm but returns it as a DTensor (torch.as_tensor, a format spec, "
    "stacking it with plain tensors fail): write fsdp_bridge.clip_grad_norm_({obj}, max_norm) for both branches "
    "(it takes any module and does what its own clipping does: FSDP1's, FSDP2's, DDP, plain; the norm a plain "
    "tensor)"
)
"""The TODO for ``hasattr(m, "clip_grad_norm_")`` in a tree that makes FSDP1 models."""

DUCK_NO_SYNC = (
    "left as it is; a test for FSDP1's (or DDP's) wrapper by its method: a model fsdp_bridge.shard() makes on "
    "FSDP2 has no no_sync, so the other branch runs for it (gradients reduced at every micro-step: more "
    "communication, and sums rounded per micro-step rather than once, so fp32 losses drift in their last "
    "digits); fsdp_bridge.no_sync({obj}) takes any module and skips the reduction"
)
"""The note for ``hasattr(m, "no_sync")`` in a tree that makes FSDP1 models, where the call it guards is not
``m.no_sync()`` (arguments: another object's method)."""

DUCK_NO_SYNC_NO_BACKWARD = (
    "left as it is; a test for FSDP1's (or DDP's) wrapper by its method: a model fsdp_bridge.shard() makes on "
    "FSDP2 has no no_sync, so the other branch runs for it; this file calls no backward(), and no_sync acts only "
    "in backward (it skips the gradient reduction), so nothing changes here (where a backward does run under it, "
    "fsdp_bridge.no_sync({obj}) takes any module and skips the reduction)"
)
"""The note for such a test in a file that runs no backward pass (inference under ``no_sync``)."""

DUCK_CALL = (
    "fsdp_bridge.no_sync({obj}), under the test for its method: the same call for any object with a no_sync() "
    "of its own (FSDP1's, DDP's, another library's), and the bridge's FSDP2 models skip the reduction too"
)
"""The fix of ``m.no_sync()`` guarded by ``hasattr(m, "no_sync")``."""

GETATTR_TEXT = (
    "not rewritten: FSDP1's wrapper has {m}, a model fsdp_bridge.shard() makes on FSDP2 has not: this raises "
    "AttributeError there; write fsdp_bridge.{m}({obj}, ...) where it is called (it takes any module)"
)
"""The TODO for ``getattr(m, "no_sync")`` (no default) in a tree that makes FSDP1 models."""

_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "scatter",
        "gather",
        "send",
        "recv",
        "isend",
        "irecv",
        "_broadcast_coalesced",
    }
)
_SHAPE_ATTRIBUTES = ("ndim", "shape")
_SHAPE_METHODS = ("numel", "dim", "size", "nelement")
_COMPREHENSIONS = (cst.GeneratorExp, cst.ListComp, cst.SetComp, cst.DictComp)


def _parameters_of(node: cst.CSTNode) -> cst.BaseExpression | None:
    """``X`` of ``X.parameters()`` / ``X.named_parameters()`` (no argument), else None."""
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value in ("parameters", "named_parameters")
        and not node.args
    ):
        return node.func.value
    return None


def _splits_groups(body: cst.CSTNode, param: str) -> bool:
    """``body`` has an ``if`` testing ``param``'s shape whose branches append to lists, or is a comprehension
    filtered by its shape (``[p for p in m.parameters() if p.ndim > 1]``): a parameter-group split."""

    def shape_test(test: cst.CSTNode) -> bool:
        return any(
            isinstance(a, cst.Attribute)
            and m.matches(a.value, m.Name(param))
            and a.attr.value in (*_SHAPE_ATTRIBUTES, *_SHAPE_METHODS)
            for a in walk(test)
        )

    if isinstance(body, _COMPREHENSIONS):
        for_in: cst.CompFor | None = body.for_in
        while for_in is not None:
            if any(shape_test(c.test) for c in for_in.ifs):
                return True
            for_in = for_in.inner_for_in
        return False
    for n in walk(body):
        if not isinstance(n, cst.If) or not shape_test(n.test):
            continue
        if any(
            isinstance(c, cst.Call) and isinstance(c.func, cst.Attribute) and c.func.attr.value == "append"
            for c in walk(n)
        ):
            return True
    return False


class NoSyncClipFixer(ScannerBase):
    """The wrapper's no_sync and clip_grad_norm_; torch's clip over an FSDP1 model's parameters (a note)."""

    def _note_local_clip(self, node: cst.Call) -> None:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), n)`` with ``model`` shown to be FSDP1's wrapper:
        a note in the report (the call stays; what it computes changes, see :data:`LOCAL_CLIP`)."""
        if self.planning or not node.args or node.args[0].keyword is not None:
            return
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if not names & {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_"}:
            return
        params = node.args[0].value
        made_of = params
        if isinstance(params, cst.Name) and self.functions:
            # ``grads = [p for p in model.parameters() if p.requires_grad]`` (or ``list(...)``) above, assigned once
            made = [
                n.value
                for n in walk(self.functions[-1])
                if isinstance(n, cst.Assign) and any(m.matches(t.target, m.Name(params.value)) for t in n.targets)
            ]
            whole = len(made) == 1 and (  # the list itself, not one branch's of a choice (an IfExp)
                isinstance(made[0], (cst.ListComp, cst.GeneratorExp))
                or (isinstance(made[0], cst.Call) and code_of(made[0].func) in ("list", "tuple"))
            )
            calls = [
                c
                for c in (walk(made[0]) if whole else ())
                if isinstance(c, cst.Call)
                and isinstance(c.func, cst.Attribute)
                and c.func.attr.value == "parameters"
                and not c.args
            ]
            if len(calls) == 1:
                made_of = calls[0]
        if not (
            isinstance(made_of, cst.Call)
            and isinstance(made_of.func, cst.Attribute)
            and made_of.func.attr.value == "parameters"
            and not made_of.args
        ):
            return
        construct = f"torch.nn.utils.clip_grad_norm_({short(code_of(params), 40)}, ...)"
        model = made_of.func.value
        if self._ignores_some(model) and self._shown_fsdp1(node, model):
            # FSDP(model, ignored_states=...) in this function: those parameters stay plain beside the DTensors
            self._record(
                node,
                construct,
                "not rewritten: the FSDP(...) call of this function leaves some parameters out of sharding "
                "(ignored_states / ignored_modules), which stay plain tensors beside FSDP2's DTensors, so torch's "
                "clip raises at the first step (mixed torch.Tensor and DTensor); on FSDP1 each rank clipped by the "
                "norm of its own flat shard and the ignored parameters. Write fsdp_bridge.clip_grad_norm_(model, "
                "max_norm) (one global norm over both kinds) with this call's max_norm",
                False,
            )
            return
        text = LOCAL_CLIP
        if self.target == "torch":  # the torch target drops the library: its helper module's clip takes both too
            text = text.replace("fsdp_bridge.clip_grad_norm_(", f"{HELPERS_NAME}.clip_grad_norm_(")
        self._note_on_fsdp1_model(node, model, construct, text)

    def _ignores_some(self, model: cst.BaseExpression) -> bool:
        """This function wraps ``model`` with ``FSDP(..., ignored_states=...)`` / ``ignored_modules=``."""
        if not self.functions:
            return False
        return any(
            isinstance(n, cst.Assign)
            and any(code_of(t.target) == code_of(model) for t in n.targets)
            and isinstance(n.value, cst.Call)
            and self._qn(n.value.func) == (FSDP, "")
            and any(
                a.keyword is not None
                and a.keyword.value in ("ignored_states", "ignored_modules")
                and not m.matches(a.value, m.Name("None"))
                for a in n.value.args
            )
            for n in walk(self.functions[-1])
        )

    def _parameter_loops(self) -> dict[str, cst.BaseExpression]:
        """The enclosing ``for p in X.parameters():`` / ``for n, p in X.named_parameters():`` loops: loop
        variable -> X."""
        loops: dict[str, cst.BaseExpression] = {}
        for stmt in self.stmt_stack:
            if isinstance(stmt, cst.For) and (model := _parameters_of(stmt.iter)) is not None:
                target: cst.BaseExpression = stmt.target
                if isinstance(target, cst.Tuple) and len(target.elements) == 2:
                    target = target.elements[1].value
                if isinstance(target, cst.Name):
                    loops[target.value] = model
        return loops

    def _note_param_collective(self, node: cst.Call) -> None:
        """``dist.all_reduce(p.data)`` in ``for p in model.parameters():``, or
        ``dist.all_reduce_coalesced(list(model.parameters()))``, with ``model`` shown to be FSDP1's wrapper: a
        TODO (see :data:`PARAM_COLLECTIVE`). Inside a gathering ``summon_full_params`` block it is left alone."""
        if self.planning or not node.args:
            return
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if not any(q.startswith("torch.distributed.") and q.rsplit(".", 1)[-1] in _COLLECTIVES for q in names):
            return
        if self._in_summon():
            return
        loops = self._parameter_loops()
        for arg in node.args:
            model = next((x for c in walk(arg.value) if (x := _parameters_of(c)) is not None), None)
            root = arg.value
            while isinstance(root, cst.Attribute) and root.attr.value in ("data", "grad"):
                root = root.value
            if model is None and isinstance(root, cst.Name):
                model = loops.get(root.value)
            if model is not None and self._shown_fsdp1(node, model):
                construct = f"{short(code_of(node.func), 30)}({short(code_of(arg.value), 40)}) over FSDP1 parameters"
                self._record(node, construct, PARAM_COLLECTIVE, False)
                return
        self._note_grad_collective(node)

    def _note_param_sum(self, node: cst.Call) -> None:
        """``total += torch.norm(p.data)`` (a reduction of the loop's parameter added in place) in
        ``for p in model.parameters():`` with ``model`` shown to be FSDP1's wrapper: a TODO (see
        :data:`PARAM_SUM`). Inside a ``summon_full_params`` block, or reading ``to_local()`` already, it is left
        alone."""
        if self.planning or not self.stmt_stack:
            return
        stmt = self.stmt_stack[-1]
        func = node.func
        name = func.attr.value if isinstance(func, cst.Attribute) else code_of(func)
        if (
            not isinstance(stmt, cst.SimpleStatementLine)
            or id(stmt) in self.todos
            or name.rsplit(".", 1)[-1] not in _REDUCTIONS
            or not any(
                isinstance(small, cst.AugAssign)
                and isinstance(small.operator, cst.AddAssign)
                and any(n is node for n in walk(small.value))
                for small in stmt.body
            )
            or self._in_summon()
        ):
            return
        loops = self._parameter_loops()
        read = [n.value for n in walk(node) if isinstance(n, cst.Name) and n.value in loops]
        if not read or any(
            isinstance(n, cst.Attribute) and n.attr.value in ("to_local", "full_tensor") for n in walk(node)
        ):
            return
        owner = loops[read[0]]
        while True:  # the model's own parameters, or a submodule's (model.module.decoders.parameters())
            if self._shown_fsdp1(node, owner):
                self._record(node, f"+= {short(code_of(node), 50)} over FSDP1 parameters", PARAM_SUM, False)
                return
            if not isinstance(owner, cst.Attribute):
                return
            owner = owner.value

    def _note_grad_collective(self, node: cst.Call) -> None:
        """``dist.all_reduce(norm)`` where ``norm`` comes, in this function, from parameters' ``.grad`` (read here
        or in a function of this file it calls: a hand-written gradient norm), in a tree that makes FSDP1 models:
        a note (see :data:`GRAD_COLLECTIVE`); the parameters' model is not followed, so no TODO."""
        if self.dispatch.wraps_fsdp1 is None or not self.functions or not node.args:
            return
        fn = self.functions[-1]
        readers = _grad_readers(self.module) if self.module is not None else set()

        def made_from(expr: cst.CSTNode) -> tuple[bool, bool]:
            """(reads gradients, takes their norm): ``p.grad``, a name made from them, a gradient-norm function."""
            grads = norm = False
            for n in walk(expr):
                if isinstance(n, cst.Attribute) and n.attr.value in ("to_local", "full_tensor"):
                    return False, False  # written for DTensors already
                if isinstance(n, cst.Attribute) and n.attr.value == "grad":
                    grads = True
                elif isinstance(n, cst.Name) and n.value in derived:
                    grads, norm = True, norm or derived[n.value]
                elif isinstance(n, cst.Call) and code_of(n.func).removeprefix("self.") in readers:
                    grads = norm = True
            calls = any(  # a norm, or its square written out (``g.float().square().sum()``, ``g.pow(2).sum()``)
                isinstance(n, cst.Call)
                and any(k in code_of(n.func).rsplit(".", 1)[-1] for k in ("norm", "square", "pow"))
                for n in walk(expr)
            )
            return grads, norm or (grads and calls)

        derived: dict[str, bool] = {}  # name -> whether it holds a norm of gradients
        changed = True
        while changed:  # names assigned from gradients, through other names (a fixpoint: loops assign late)
            changed = False
            for n in walk(fn):
                if isinstance(n, (cst.Assign, cst.AugAssign, cst.AnnAssign)) and n.value is not None:
                    targets = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
                    grads, norm = made_from(n.value)
                    for t in targets:
                        if grads and isinstance(t, cst.Name) and derived.get(t.value) not in (norm, True):
                            derived[t.value] = norm or derived.get(t.value, False)
                            changed = True
        arg = node.args[0].value
        if isinstance(arg, cst.Name) and derived.get(arg.value):
            pos = self.get_metadata(PositionProvider, node).start
            construct = f"{short(code_of(node.func), 30)}({arg.value}) (a value made from gradients)"
            self.findings.append(
                CodeFinding(self.path, pos.line, pos.column, construct, GRAD_COLLECTIVE, True, note=True)
            )

    def _note_duck_typed_wrapper(self, node: cst.Call) -> None:
        """``hasattr(m, "clip_grad_norm_")`` / ``hasattr(m, "no_sync")`` (or ``getattr(m, name, default)``) in a tree
        some file of which names FSDP1's wrapper: the test picks FSDP1's models by their method, which FSDP2's
        lack. Settled by :meth:`settle_duck_tests` once the calls it guards are known; ``getattr(m, name)`` with no
        default raises on FSDP2's models: a TODO at once."""
        if self.planning or self.dispatch.wraps_fsdp1 is None or not self.stmt_stack:
            return
        test = "hasattr" if m.matches(node.func, m.Name("hasattr")) else "getattr"
        if not m.matches(node.func, m.Name("getattr") | m.Name("hasattr")) or not 2 <= len(node.args) <= 3:
            return
        if not isinstance(node.args[1].value, cst.SimpleString) or (test == "hasattr" and len(node.args) == 3):
            return
        method = node.args[1].value.evaluated_value
        if method not in ("clip_grad_norm_", "no_sync"):
            return
        obj = code_of(node.args[0].value)
        stmt = self.stmt_stack[-1]
        pos = self.get_metadata(PositionProvider, node).start
        if test == "getattr" and len(node.args) == 2:
            # no default: an AttributeError on the bridge's FSDP2 models
            self.fsdp1_elsewhere = True
            self._record(node, f'getattr({short(obj, 40)}, "{method}")', GETATTR_TEXT.format(obj=obj, m=method), False)
            return
        if f"fsdp_bridge.is_sharded({obj})" in code_of(stmt):
            return  # rewritten by an earlier --fix
        guarded = [
            (
                c,
                (
                    self.get_metadata(PositionProvider, c).start.line,
                    self.get_metadata(PositionProvider, c).start.column,
                ),
            )
            for c in walk(stmt)
            if isinstance(c, cst.Call)
            and isinstance(c.func, cst.Attribute)
            and c.func.attr.value == method
            and code_of(c.func.value) == obj
        ]
        if method == "no_sync" and any(
            isinstance(e, cst.Expr) and any(e.value is c for c, _ in guarded) for e in walk(stmt)
        ):
            self.bare_no_sync.add(id(stmt))  # m.no_sync() called as a statement: another object's own switch
        self.duck_tests.append((node, stmt, obj, method, guarded, (pos.line, pos.column)))

    def settle_duck_tests(self) -> None:
        """Each duck-typed test of :meth:`_note_duck_typed_wrapper`: where the call it guards became
        ``fsdp_bridge.<method>(m, ...)`` (``m`` shown to be FSDP1's), the test also lets the bridge's models in
        (``hasattr(m, ...) or fsdp_bridge.is_sharded(m)``: else the rewrite is never reached on FSDP2); where it
        did not, a TODO (clip: the other branch's torch clip returns a DTensor) or a note (no_sync)."""
        for node, stmt, obj, method, guarded, (line, column) in self.duck_tests:
            spelled = "hasattr" if m.matches(node.func, m.Name("hasattr")) else "getattr"
            rest = "" if spelled == "hasattr" else ", ..."
            construct = f'{spelled}({short(obj, 40)}, "{method}"{rest}) (FSDP1\'s wrapper told by its method)'
            if (
                method == "no_sync"
                and guarded
                and all(not c.args for c, _ in guarded)
                and id(stmt) not in self.bare_no_sync
            ):
                # ``if hasattr(m, "no_sync"): m.no_sync()``: fsdp_bridge.no_sync(m) is m's own call for any object
                # that has one (DDP, FSDP1, another library's), so the rewrite holds whatever m is
                for c, (at_line, at_column) in guarded:
                    if self.fixable_calls.get(id(c)) != "method":
                        self.fsdp1_elsewhere = True  # written in a file that may import nothing of FSDP1's
                        self.fixable_calls[id(c)] = "method"
                        self._drop_todos_at(at_line, at_column)  # an earlier "not shown to be FSDP1's" TODO
                        call = f"{short(obj, 40)}.no_sync()"
                        text = DUCK_CALL.format(obj=short(obj, 40))
                        self.findings.append(CodeFinding(self.path, at_line, at_column, call, text, True))
            if any(self.fixable_calls.get(id(g)) == "method" for g, _ in guarded):
                self.call_rewrites[id(node)] = f'(hasattr({obj}, "{method}") or fsdp_bridge.is_sharded({obj}))'
                text = (
                    f'(hasattr(..., "{method}") or fsdp_bridge.is_sharded({short(obj, 40)})): the bridge\'s FSDP2 '
                    f"models have no {method}, and the call it guards is fsdp_bridge.{method} now"
                )
                self.findings.append(CodeFinding(self.path, line, column, construct, text, True))
            elif method == "clip_grad_norm_":
                self.fsdp1_elsewhere = True  # the TODO is written into a file that imports nothing of FSDP1's
                text = " ".join(DUCK_CLIP.format(obj=short(obj, 40)).split())
                self.findings.append(CodeFinding(self.path, line, column, construct, text, False))
                self.todos.setdefault(id(stmt), []).append(f"{construct}: {text}")
            else:
                text = DUCK_NO_SYNC.format(obj=short(obj, 40))
                if not any("backward(" in row.split("#", 1)[0] for row in self.lines):
                    text = DUCK_NO_SYNC_NO_BACKWARD.format(obj=short(obj, 40))
                self.findings.append(CodeFinding(self.path, line, column, construct, text, True, note=True))

    def _drop_todos_at(self, line: int, column: int) -> None:
        """Take back the TODOs recorded for the construct at ``line``:``column`` (rewritten after all)."""
        dropped = [f for f in self.findings if (f.line, f.column) == (line, column) and not f.fixable]
        if not dropped:
            return
        texts = {f"{f.construct}: {f.replacement}" for f in dropped}
        self.findings = [f for f in self.findings if f not in dropped]
        for key, todos in self.todos.items():
            self.todos[key] = [t for t in todos if t not in texts]

    def _beside_a_ddp_branch(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool:
        """``node`` is in a branch of an ``if``/``elif`` chain another branch of which tests
        ``isinstance(obj, DistributedDataParallel)`` (``if fsdp and offload: obj.no_sync() elif isinstance(obj,
        DDP): obj.no_sync()``): there ``obj`` is not DDP's, so its call is not DDP's either."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        here = self.get_metadata(PositionProvider, node).start

        def inside(body: cst.CSTNode) -> bool:
            span = self.get_metadata(PositionProvider, body)
            return (span.start.line, span.start.column) <= (here.line, here.column) <= (span.end.line, span.end.column)

        def tests_ddp(test: cst.BaseExpression) -> bool:
            return any(
                isinstance(c, cst.Call)
                and m.matches(c.func, m.Name("isinstance"))
                and len(c.args) == 2
                and code_of(c.args[0].value) == code_of(obj)
                and "ddp"
                in wrapper_kinds_named(
                    q for x in walk(c.args[1].value) for q in self.get_metadata(QualifiedNameProvider, x, set())
                )
                for c in walk(test)
            )

        for n in walk(scope) if scope is not None else ():
            if not isinstance(n, cst.If):
                continue
            branches: list[tuple[cst.BaseExpression | None, cst.CSTNode]] = []
            part: cst.If | cst.Else | None = n
            while part is not None:
                if isinstance(part, cst.If):
                    branches.append((part.test, part.body))
                    part = part.orelse
                else:
                    branches.append((None, part.body))
                    part = None
            if any(
                isinstance(x, cst.UnaryOperation) and isinstance(x.operator, cst.Not)
                for test, _ in branches
                if test is not None
                for x in walk(test)
            ):
                continue  # ``if not isinstance(m, DDP): ... else: m.no_sync()``: the negation is not followed
            ddp = [i for i, (test, _) in enumerate(branches) if test is not None and tests_ddp(test)]
            mine = [i for i, (_, body) in enumerate(branches) if inside(body)]
            if ddp and mine and mine[0] not in ddp:
                return True
        return False

    def _shown_fsdp1(self, node: cst.CSTNode, model: cst.BaseExpression) -> bool:
        """``model`` is shown to be FSDP1's wrapper at ``node`` (wrapped in this function, handed by a call of
        the tree, or made by a function of the tree; ``self.x`` kept from such a parameter, the base class's
        ``__init__`` too: ``super().__init__(model=FSDP(...))``)."""
        return (
            self._fsdp1_wrapper(node, model, by_calls=False) != ""
            or self._handed_parameter(node, model)
            or self._factory_result(node, model) != ""
            or (
                isinstance(model, cst.Attribute)
                and m.matches(model.value, m.Name("self"))
                and bool(self.classes)
                and not self._isinstance_branch(node, model)
                and self._kept_from_a_handed_parameter(self.classes[-1], model.attr.value)
            )
        )

    def _note_on_fsdp1_model(self, node: cst.Call, model: cst.BaseExpression, construct: str, text: str) -> None:
        """A note at ``node`` when ``model`` is shown to be FSDP1's wrapper there (see :meth:`_shown_fsdp1`), or a
        submodule read from one (``model.model``: its parameters are the flat ones of the units nested in it)."""
        inside = isinstance(model, cst.Attribute) and self._shown_fsdp1(node, model.value)
        if not (inside or self._shown_fsdp1(node, model)):
            return
        pos = self.get_metadata(PositionProvider, node)
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, construct, text, True, note=True))

    def _note_shard_shapes(self, node: cst.Call) -> None:
        """``for name, p in model.named_parameters(): ... p.ndim ...`` (or ``parameters()``, a comprehension) with
        ``model`` shown to be FSDP1's wrapper: a note in the report (see :data:`SHARD_SHAPES`)."""
        func = node.func
        if (
            self.planning
            or not isinstance(func, cst.Attribute)
            or func.attr.value not in ("parameters", "named_parameters")
            or not self.stmt_stack
        ):
            return
        target: cst.BaseExpression | None = None
        body: cst.CSTNode | None = None
        stmt = self.stmt_stack[-1]
        if isinstance(stmt, cst.For) and stmt.iter is node:
            target, body = stmt.target, stmt.body
        else:
            for c in walk(stmt):
                if isinstance(c, _COMPREHENSIONS):
                    for_in: cst.CompFor | None = c.for_in
                    while for_in is not None and for_in.iter is not node:
                        for_in = for_in.inner_for_in
                    if for_in is not None:
                        target, body = for_in.target, c
                        break
        name: cst.BaseExpression | None = None
        if isinstance(target, cst.Tuple) and func.attr.value == "named_parameters" and len(target.elements) == 2:
            name, target = target.elements[0].value, target.elements[1].value
        if not isinstance(target, cst.Name) or body is None:
            return
        if self._in_summon():
            return  # gathered: FSDP1's parameters have their full shapes there too
        param = target.value
        read = next(
            (
                f"{param}.{n.attr.value}"
                for n in walk(body)
                if isinstance(n, cst.Attribute)
                and m.matches(n.value, m.Name(param))
                and n.attr.value in (*_SHAPE_ATTRIBUTES, *_SHAPE_METHODS)
            ),
            None,
        )
        if (
            read is None
            and m.matches(func.value, m.Name("self"))
            and self._in_a_method_called_on_fsdp1()
            and self.functions[-1].name.value != "forward"  # inside FSDP1's forward the parameters are whole
        ):
            # nanoGPT's configure_optimizers: {n: p for n, p in self.named_parameters()}, then p.dim() >= 2 over
            # that dict; called on the FSDP1 model, whose wrapper hands it to the module with its flat parameters
            read = next(
                (
                    n.attr.value
                    for n in walk(self.functions[-1])
                    if isinstance(n, cst.Attribute)
                    and n.attr.value in ("dim", "ndim", "shape", "numel")
                    and isinstance(n.value, cst.Name)
                    and n.value.value in _loop_targets(self.functions[-1])
                ),
                None,
            )
            if read is not None:
                pos = self.get_metadata(PositionProvider, node).start
                method = self.functions[-1].name.value
                construct = f"{short(code_of(node), 40)} in {method}(), which reads .{read} (called on the FSDP1 model)"
                self.findings.append(
                    CodeFinding(self.path, pos.line, pos.column, construct, SHARD_SHAPES, True, note=True)
                )
                return
        if read is not None and _splits_groups(body, param) and self._shown_fsdp1(node, func.value):
            self._record(node, f"{short(code_of(node), 40)} split into groups by {read}", SHAPE_GROUPS, False)
        elif (
            read is not None
            and read.endswith(".numel")
            and (reduced := self._all_reduced_count(stmt)) is not None
            and self._shown_fsdp1(node, func.value)
        ):
            construct = f"{short(code_of(node), 40)} counted by {read}() and added across ranks ({reduced})"
            self._record(node, construct, SUMMED_COUNT, False)
        elif read is not None:
            self._note_on_fsdp1_model(node, func.value, f"{short(code_of(node), 40)} read as {read}", SHARD_SHAPES)
        elif isinstance(name, cst.Name) and (rule := _name_rule(body, name.value)):
            self._note_on_fsdp1_model(node, func.value, f"{short(code_of(node), 40)} names tested ({rule})", FLAT_NAMES)

    def _all_reduced_count(self, stmt: cst.CSTNode) -> str | None:
        """``stmt`` assigns a name (``n = sum(p.numel() for p in ...)``) that a later ``all_reduce`` of the
        enclosing function (or module) takes, itself or through names assigned from it
        (``t = torch.tensor([n])``): the all_reduce call's text, else None."""
        if not isinstance(stmt, cst.SimpleStatementLine) or not isinstance(stmt.body[0], (cst.Assign, cst.AugAssign)):
            return None
        first = stmt.body[0]
        targets = [t.target for t in first.targets] if isinstance(first, cst.Assign) else [first.target]
        counted = {t.value for t in targets if isinstance(t, cst.Name)}
        scope = self.functions[-1] if self.functions else self.module
        if not counted or scope is None:
            return None
        derived = names_from(scope, counted)  # names assigned from it, and from those
        for n in walk(scope):
            if (
                isinstance(n, cst.Call)
                and code_of(n.func).rsplit(".", 1)[-1] == "all_reduce"
                and n.args
                and isinstance(n.args[0].value, cst.Name)
                and n.args[0].value.value in derived
            ):
                return short(code_of(n), 60)
        return None

    def _in_a_method_called_on_fsdp1(self) -> bool:
        """The enclosing function is a method of a class (not FSDP1's own subclass) whose name a call of the tree
        makes on an FSDP1 model (``Dispatch.fsdp1_methods``): FSDP1's wrapper hands such a call to the module."""
        if not self.functions or not self.classes:
            return False
        fn = self.functions[-1]
        return (
            fn.name.value in self.dispatch.fsdp1_methods
            and bool(fn.params.params)
            and (fn.params.params[0].name.value == "self")
        )

    def _plan_wrapper_method_call(self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None) -> None:
        """The FSDP1 wrapper's no_sync() and clip_grad_norm_(...), its register_comm_hook (a TODO), and a
        direct ``model.forward(...)`` on it."""
        if isinstance(func, cst.Attribute) and func.attr.value == "forward" and hit is None:
            self._plan_forward_call(node, func)
            return
        if isinstance(func, cst.Attribute) and func.attr.value == "register_comm_hook" and hit is None:
            # DDP has a method of this name too: only a receiver proven FSDP1's (alone or beside DDP) is reported.
            if (self._fsdp1_wrapper(node, func.value, by_calls=False) or self._handed_fsdp1(func.value)) != "":
                hook = node.args[1].value if len(node.args) >= 2 else None
                ddp_hook = hook is not None and any(
                    q.name.startswith("torch.distributed.algorithms.ddp_comm_hooks")
                    for q in self.get_metadata(QualifiedNameProvider, hook, set())
                )
                text = DDP_HOOK_TEXT.format(hook=short(code_of(hook), 40)) if ddp_hook and hook else COMM_HOOK_TEXT
                self._record(node, f"{short(code_of(func.value), 40)}.register_comm_hook(...)", text, False)
            return
        if isinstance(func, cst.Attribute) and func.attr.value in ("no_sync", "clip_grad_norm_") and hit is None:
            qn = {q.name for q in self.get_metadata(QualifiedNameProvider, func, set())}
            if any(q.startswith(("torch.nn", "fsdp_bridge")) for q in qn) or code_of(func.value) in (
                "fsdp_bridge",
                HELPERS_NAME,
            ):
                return  # torch.nn.utils.clip_grad_norm_ works on FSDP2; fsdp_bridge's and the helpers' are rewrites
            if self._ddp_tested(func.value) and not self._beside_a_ddp_branch(node, func.value):
                return  # DDP's no_sync (the code tells DDP apart), not FSDP1's
            name = func.attr.value
            if name == "no_sync" and node.args:
                return  # FSDP1's no_sync takes no argument: another object's (accelerate's no_sync(model))
            if name == "clip_grad_norm_" and (not node.args or params_first(node)):
                return  # FSDP1's is clip_grad_norm_(max_norm, norm_type): parameters first is another one's
            if (where := self.dispatch.own_methods.get(name)) is not None and self._fsdp1_wrapper(
                node, func.value, by_calls=False
            ) != "fsdp1":
                if code_of(func.value) == "self" and self.classes:
                    return  # the class's own method
                recv = code_of(func.value)
                # relative to this file: the same text wherever the tree is (--fix stays idempotent on a copy)
                where = "this file" if where == self.path else os.path.relpath(where, os.path.dirname(self.path) or ".")
                self._record(
                    node,
                    f"{short(recv, 40)}.{name}(...)",
                    f"not rewritten: this tree defines its own {name} (in {where}), so this call may be that one; "
                    f"if {short(recv, 40)} is the FSDP1-wrapped model, write fsdp_bridge.{name}({short(recv, 40)}"
                    f"{', ...' if node.args else ''}) (it takes any module); if it is your own, keep it",
                    False,
                )
                return
            recv = code_of(func.value)
            construct = f"{short(recv, 40)}.{name}({'...' if node.args else ''})"
            wrapper = self._fsdp1_wrapper(node, func.value, by_calls=False) or self._handed_fsdp1(func.value)
            if wrapper == "":
                self._record(node, construct, unproven_text(recv, name), False)
                return
            self.fixable_calls[id(node)] = "method"
            text = NAMES[name]
            if wrapper == "ambiguous":
                text += (
                    f"; {short(recv, 40)} may be DistributedDataParallel's here: fsdp_bridge.{name} does what "
                    f"DDP's own {'no_sync()' if name == 'no_sync' else 'clipping'} does for it"
                )
            self._record(node, construct, text, True)
            return

    def _handed_fsdp1(self, obj: cst.BaseExpression) -> str:
        """ "fsdp1" when ``obj`` is a parameter of the enclosing function that a call of the tree passes a model
        it wrapped with ``FSDP(...)`` (``Dispatch.fsdp1_args``), or ``x.attr`` where a class of this file
        assigns ``self.attr = FSDP(...)`` / ``wrap(...)``; else ""."""
        if isinstance(obj, cst.Name) and self.functions:
            fn = self.functions[-1]
            params = [p.name.value for p in fn.params.params]
            if obj.value in handed_parameters(self._called_as(fn), params, self.dispatch.fsdp1_args):
                return "fsdp1"
            if self._made_by_factory(fn, obj.value):
                return "fsdp1"
        if (
            isinstance(obj, cst.Attribute)
            and m.matches(obj.value, m.Name("self"))
            and self.classes
            and (
                self._inherits_fsdp1_attribute(self.classes[-1], obj.attr.value)
                or self._kept_from_a_handed_parameter(self.classes[-1], obj.attr.value)
            )
        ):
            return "fsdp1"
        if isinstance(obj, cst.Attribute) and self.module is not None:
            for n in walk(self.module):
                if (
                    isinstance(n, cst.Assign)
                    and isinstance(n.value, cst.Call)
                    and any(m.matches(t.target, m.Attribute(m.Name("self"), m.Name(obj.attr.value))) for t in n.targets)
                    and self._qn(n.value.func) in ((FSDP, ""), ("wrap", ""))
                ):
                    return "fsdp1"
        return ""

    def _kept_from_a_handed_parameter(self, cls: cst.ClassDef, attr: str) -> bool:
        """A method of ``cls`` keeps a parameter a call of the tree passes an FSDP1 model as on the instance
        (``def prepare(self, model): self.model = model``, called ``trainer.prepare(model=FSDP(...))``), and no
        method of it assigns ``self.<attr>`` anything else (``None`` aside, a placeholder): ``self.<attr>`` is that
        model in every method."""
        kept = False
        for fn in walk(cls):
            if not isinstance(fn, cst.FunctionDef):
                continue
            params = [p.name.value for p in fn.params.params]
            handed = handed_parameters(called_as(fn.name.value, cls.name.value), params, self.dispatch.fsdp1_args)
            for n in walk(fn):
                if not isinstance(n, (cst.Assign, cst.AnnAssign)) or n.value is None:
                    continue
                targets = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
                if any(m.matches(t, m.Attribute(m.Name("self"), m.Name(attr))) for t in targets):
                    if m.matches(n.value, m.Name("None")):
                        continue  # a placeholder set in __init__ before the model is handed over
                    if not (isinstance(n.value, cst.Name) and n.value.value in handed):
                        return False  # assigned something else too: not shown
                    kept = True
        return kept

    def _plan_forward_call(self, node: cst.Call, func: cst.Attribute) -> None:
        """``model.forward(...)`` on FSDP1's wrapper (shown by the function, handed by a call of the tree, or
        made by a function of the tree): FSDP1's wrapper gathers its parameters in its own forward(); FSDP2
        does it in hooks that run only when the module is called, so ``model(...)`` in its place (the same
        forward on FSDP1's wrapper, DDP's and FSDP2's modules)."""
        recv = func.value
        if not isinstance(recv, (cst.Name, cst.Attribute)) or code_of(recv) == "self":
            return
        if not (
            self._fsdp1_wrapper(node, recv, by_calls=False) != ""
            or self._handed_parameter(node, recv)
            or self._factory_result(node, recv) != ""
        ):
            return
        code = code_of(node.with_changes(func=recv))
        self.call_rewrites[id(node)] = code
        self._record(
            node,
            f"{short(code_of(recv), 40)}.forward(...)",
            f"{short(code, 60)}: FSDP2 gathers a module's parameters in hooks that run when the module is called, "
            "not in forward() itself (FSDP1's wrapper gathers in its forward()); calling it runs the same forward "
            "on FSDP1's wrapper, DDP's and FSDP2's modules",
            True,
        )

    def _called_as(self, fn: cst.FunctionDef) -> str:
        """How calls name ``fn`` (the class for ``__init__``), the key of ``Dispatch.fsdp1_args``."""
        return called_as(fn.name.value, self.classes[-1].name.value if self.classes else None)

    def _handed_parameter(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool:
        """``obj`` at ``node`` is a parameter of the enclosing function that a call of the tree passes an FSDP1
        model as (``Dispatch.fsdp1_args``), not tested by an isinstance guard around ``node`` and not assigned
        anew above it in the function: the object the caller handed."""
        if not (isinstance(obj, cst.Name) and self.functions):
            return False
        fn = self.functions[-1]
        if obj.value not in handed_parameters(
            self._called_as(fn), [p.name.value for p in fn.params.params], self.dispatch.fsdp1_args
        ):
            return False
        if self._isinstance_branch(node, obj):
            return False  # the guard decides (see _fsdp1_wrapper)
        limit = self.get_metadata(PositionProvider, node).start
        for n in walk(fn.body):
            if isinstance(n, (cst.Assign, cst.AnnAssign, cst.AugAssign, cst.For, cst.WithItem)):
                targets = (
                    [t.target for t in n.targets]
                    if isinstance(n, cst.Assign)
                    else [n.asname.name]
                    if isinstance(n, cst.WithItem) and n.asname is not None
                    else []
                    if isinstance(n, cst.WithItem)
                    else [n.target]
                )
                if any(binds(t, obj.value) for t in targets):
                    span = self.get_metadata(PositionProvider, n)
                    # an assignment ends above (model = model.module holding the node does not count); a loop or
                    # with binds its name before its body runs
                    if _before(span.start if isinstance(n, (cst.For, cst.WithItem)) else span.end, limit):
                        return False  # assigned anew above: not (only) the object handed
        return True

    def _inherits_fsdp1_attribute(self, cls: cst.ClassDef, attr: str) -> bool:
        """``self.attr`` in ``cls``, a subclass of a class of the tree (by the last part of its base's name) whose
        methods assign ``self.attr = FSDP(...)`` (``Dispatch.fsdp1_attributes``), and that ``cls`` never assigns
        itself: FSDP1's model, made by the base class."""
        bases = {code_of(b.value).rsplit(".", 1)[-1] for b in cls.bases}
        if not any(attr in self.dispatch.fsdp1_attributes.get(b, ()) for b in bases):
            return False
        return not any(
            isinstance(n, (cst.Assign, cst.AnnAssign, cst.AugAssign))
            and any(
                m.matches(t, m.Attribute(m.Name("self"), m.Name(attr)))
                for t in ([x.target for x in n.targets] if isinstance(n, cst.Assign) else [n.target])
            )
            for n in walk(cls.body)
        )

    def _made_by_factory(self, fn: cst.FunctionDef, name: str, before: cst.CSTNode | None = None) -> str:
        """The function ``f`` when ``name = f(...)`` or ``name, other = f(...)`` in ``fn`` (above ``before``, when
        given, and not assigned anew between), with ``f`` a function of the tree whose result (or that element
        of it) is an FSDP1 model (``Dispatch.fsdp1_results``); else ""."""
        results = self.dispatch.fsdp1_results
        limit = self.get_metadata(PositionProvider, before).start if before is not None else None
        blocks = [self.get_metadata(PositionProvider, b) for b in walk(fn.body) if isinstance(b, cst.IndentedBlock)]

        def on_the_way(n: cst.CSTNode) -> bool:
            """The block that holds assignment ``n`` holds ``before`` too: ``n`` runs on the way there, not in a
            branch beside it (``if ds: model, *_ = deepspeed.initialize(...)`` beside ``else: model = f(...)``
            leaves ``model`` f's result on one path: a factory's result still, for a guarded form)."""
            at = self.get_metadata(PositionProvider, n)
            holders = [
                b for b in blocks if not _before(at.start, b.start) and not _before(b.end, at.end)
            ]  # blocks around n
            if not holders or limit is None:
                return True
            inner = max(holders, key=lambda b: (b.start.line, b.start.column))
            return not _before(limit, inner.start) and not _before(inner.end, limit)

        found = ""
        for n in walk(fn.body):
            if limit is not None and not (
                isinstance(n, (cst.Assign, cst.AnnAssign, cst.AugAssign))
                and _before(self.get_metadata(PositionProvider, n).end, limit)  # ended above: not the node's own
            ):
                continue
            if not isinstance(n, cst.Assign):
                if (
                    limit is not None
                    and m.matches(cast("cst.AnnAssign | cst.AugAssign", n).target, m.Name(name))
                    and on_the_way(n)
                ):
                    found = ""  # assigned anew
                continue
            targets = [t.target for t in n.targets]
            positions = (
                results.get(code_of(n.value.func).rsplit(".", 1)[-1], set()) if isinstance(n.value, cst.Call) else set()
            )
            made = any(
                (-1 in positions and m.matches(t, m.Name(name)))
                or (
                    isinstance(t, cst.Tuple)
                    and any(i in positions and m.matches(e.value, m.Name(name)) for i, e in enumerate(t.elements))
                )
                for t in targets
            )
            if made:
                found = code_of(cast(cst.Call, n.value).func)
                if limit is None:
                    return found
            elif limit is not None and any(binds(t, name) for t in targets) and on_the_way(n):
                found = ""  # assigned anew
        return found


def binds(target: cst.BaseExpression, name: str) -> bool:
    """Assigning to ``target`` rebinds ``name`` (``name = ...``, ``name, other = ...``), not an attribute or an
    item of it (``name.attr = ...``)."""
    if isinstance(target, cst.Name):
        return target.value == name
    if isinstance(target, (cst.Tuple, cst.List)):
        return any(binds(e.value, name) for e in target.elements)
    return False


def _before(a: CodePosition, b: CodePosition) -> bool:
    return (a.line, a.column) < (b.line, b.column)


COMM_HOOK_TEXT = (
    "not rewritten: FSDPModule has no register_comm_hook; FSDP1's hook replaces the reduction of each unit's "
    "flat gradient, and FSDP2 reduces each parameter's gradient itself (its nearest hooks are "
    "set_all_reduce_hook, torch 2.7+, and set_custom_reduce_scatter, 2.9+, with other signatures): port the hook "
    'to those, or shard this model with fsdp_bridge.BridgeConfig(backend="fsdp1"), where the wrapper keeps it'
)
"""The TODO for ``model.register_comm_hook(state, hook)`` on a model proven FSDP1's."""

DDP_HOOK_TEXT = (
    "not rewritten: {hook} is a DDP communication hook (torch.distributed.algorithms.ddp_comm_hooks, called as "
    "hook(state, bucket)); FSDP1 calls its hooks as hook(state, grad[, output]), so this one raised TypeError at "
    "the first backward on FSDP1 too, and FSDPModule has no register_comm_hook: remove the call (DDP keeps such "
    "hooks, where gradient compression is wanted)"
)
"""The TODO for ``model.register_comm_hook(state, hook)`` given one of DDP's hooks."""


def params_first(node: cst.Call) -> bool:
    """``x.clip_grad_norm_(parameters, max_norm)``: a keyword ``max_norm=`` after a positional argument, or a
    first argument that holds parameters (``m.parameters()``, a name with "param" in it). FSDP1's method is
    ``clip_grad_norm_(max_norm, norm_type=2.0)``, so the call is another object's (accelerate's, torch's)."""
    positional = [a for a in node.args if a.keyword is None and not a.star]
    keywords = {a.keyword.value for a in node.args if a.keyword is not None}
    if positional and "max_norm" in keywords:
        return True
    if "parameters" in keywords:
        return True
    if not positional:
        return False
    first = positional[0].value
    if isinstance(first, cst.Call) and isinstance(first.func, cst.Attribute):
        return "param" in first.func.attr.value
    return "param" in code_of(first).rsplit(".", 1)[-1].lower()


def unproven_text(recv: str, name: str, *, bound: bool = False) -> str:
    """The TODO for ``recv.no_sync()`` / ``recv.clip_grad_norm_(...)`` where nothing shows ``recv`` is FSDP1's
    (``bound``: the method taken as a value, ``ctx = recv.no_sync``, called later)."""
    call = f"fsdp_bridge.{name}({short(recv, 40)}{', ...' if name == 'clip_grad_norm_' else ''})"
    if bound:
        call = f"functools.partial(fsdp_bridge.{name}, {short(recv, 40)})"
    return (
        f"not rewritten: nothing here shows {short(recv, 40)} is FSDP1's wrapper (no FSDP(...) or a factory of "
        f"the tree assigned to it in this scope, no ': FSDP' annotation, no isinstance(..., FSDP) guard), and "
        f"another object's {name} (accelerate's Accelerator, your own) must stay as it is; if it is the "
        f"FSDP1-wrapped model, write {call}, which also takes DDP, torch's fully_shard and plain modules"
    )


def _name_rule(body: cst.CSTNode, name: str) -> str:
    """The first test of the parameter name ``name`` in ``body``: ``"bias" in name`` (``not in`` too), the name
    looked up among names (``name in decay_names``), ``name.endswith(...)`` / ``startswith(...)``, as code; ""
    when there is none."""
    for n in walk(body):
        if isinstance(n, cst.Comparison) and any(
            isinstance(t.operator, (cst.In, cst.NotIn))
            and (m.matches(t.comparator, m.Name(name)) or (i == 0 and m.matches(n.left, m.Name(name))))
            for i, t in enumerate(n.comparisons)
        ):
            return short(code_of(n), 40)
        if (
            isinstance(n, cst.Call)
            and isinstance(n.func, cst.Attribute)
            and m.matches(n.func.value, m.Name(name))
            and n.func.attr.value in ("endswith", "startswith")
        ):
            return short(code_of(n), 40)
    return ""


def _grad_readers(module: cst.Module) -> set[str]:
    """The functions and methods of ``module`` that read parameters' ``.grad`` and call a norm (``p.grad`` and
    ``vector_norm``/``norm`` in their body, not written for DTensors: no ``to_local``/``full_tensor``): a
    hand-written gradient norm."""
    found = set()
    for n in walk(module):
        if isinstance(n, cst.FunctionDef):
            attrs = {a.attr.value for a in walk(n.body) if isinstance(a, cst.Attribute)}
            norms = any(isinstance(c, cst.Call) and "norm" in code_of(c.func).rsplit(".", 1)[-1] for c in walk(n.body))
            if "grad" in attrs and norms and not attrs & {"to_local", "full_tensor"}:
                found.add(n.name.value)
    return found


def _loop_targets(fn: cst.FunctionDef) -> set[str]:
    """Names a ``for`` statement or a comprehension of ``fn`` binds (``p`` in ``for n, p in ...``)."""
    out: set[str] = set()
    for n in walk(fn):
        target = n.target if isinstance(n, (cst.For, cst.CompFor)) else None
        if target is not None:
            out.update(x.value for x in walk(target) if isinstance(x, cst.Name))
    return out
