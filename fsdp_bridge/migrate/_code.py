"""``migrate code``: find FSDP1 API use in Python sources and rewrite the mechanical cases.

Sources are read as a concrete syntax tree (libcst), so a rewrite keeps every comment and
all formatting outside the rewritten expressions, and the output always parses.  Names
are resolved through the file's imports (``FSDP`` imported as an alias,
``torch.distributed.fsdp.FullyShardedDataParallel`` spelt in full, ...).

``--fix`` rewrites:

* ``FullyShardedDataParallel(model, ...)`` into ``fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig(...))``
  when every argument has an equivalent config value (policies built in a variable are followed);
* ``model.no_sync()`` -> ``fsdp_bridge.no_sync(model)``, ``model.clip_grad_norm_(...)`` ->
  ``fsdp_bridge.clip_grad_norm_(model, ...)``, ``FSDP.summon_full_params(model, writeback=...)`` ->
  ``fsdp_bridge.summon_full_params(model, writeback=...)``;
* full-state-dict saving (``with FSDP.state_dict_type(model, FULL_STATE_DICT): sd = model.state_dict()``
  followed by ``torch.save`` on rank 0) -> ``fsdp_bridge.save_checkpoint(path, model, kind="full")``,
  and full-state-dict loading -> ``fsdp_bridge.load_checkpoint(path, model)``.

Everything else gets a ``# TODO(fsdp-bridge): ...`` comment above its statement naming the
replacement.  Running it again changes nothing.  ``target="torch"`` (``--target torch``) then lowers the
bridge's calls to plain FSDP2 code (``_torch_target``) and writes ``_fsdp2_helpers.py`` beside the files.

This module is the driver (read the files, run the two passes, write all or nothing).  The parts:
``_analysis`` (where each name comes from, what other files of the tree define), ``_objects`` (which
objects are FSDP1's, code that already tells the backends apart), ``_scanner`` (pass 1, one visitor
made of the fixers in ``fixers/``, one module per construct family), ``_rewrite`` and ``_render``
(pass 2), ``_names`` (the texts findings and TODOs say).
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import PositionProvider

from fsdp_bridge.migrate._analysis import (
    OWN_FILE,
    ClassAliases,
    Collector,
    Dispatch,
    asks_backend,
    bridge_set_state_dict_type,
    calls_set_state_dict_type,
    chooses_wrapper,
    cited_set_state_dict_type,
    class_aliases,
    code_of,
    constructs_wrapper,
    find_data_swappers,
    find_dispatch,
    find_fsdp1_arguments,
    find_fsdp1_attributes,
    find_fsdp1_factories,
    find_fsdp1_predicates,
    find_instance_attributes,
    find_own_methods,
    find_param_pairers,
    find_unit_holders,
    finds_state_dict_context,
    from_imports,
    fsdp1_class_reexports,
    handed_across_files,
    imported_names,
    module_suffixes,
    names_wrapper,
    offloads_params,
    parsed,
    passes_group,
    passes_mixed_precision,
    self_spelled_set_state_dict_type,
    subclassed_names,
    subclasses_wrapper,
    tests_lightning_strategy,
    top_level_classes,
    top_level_functions,
    unfollowed_set_state_dict_type,
    walk,
    with_reexports,
)
from fsdp_bridge.migrate._names import INTERNAL_ATTRS, TODO
from fsdp_bridge.migrate._report import CodeFinding, CodeReport
from fsdp_bridge.migrate._rewrite import Rewriter
from fsdp_bridge.migrate._scanner import Scanner
from fsdp_bridge.migrate._torch_helpers import HELPERS_MARKER, HELPERS_NAME, HELPERS_SOURCE
from fsdp_bridge.migrate._torch_report import torch_findings
from fsdp_bridge.migrate._torch_target import KEPT_CONSTRUCTOR, TARGETS, lower_to_torch
from fsdp_bridge.migrate._vendored import vendored_torch_module
from fsdp_bridge.migrate.limits import SourceLimitError, notebook_uses_fsdp1, read_source

__all__ = ["MigratedSource", "MigrationWriteError", "migrate_paths", "migrate_source"]


@dataclass
class MigratedSource:
    path: str
    original: str
    fixed: str
    findings: list[CodeFinding]
    uses_helpers: bool = False
    """``--target torch``: the file imports the generated ``_fsdp2_helpers`` module beside it."""

    @property
    def changed(self) -> bool:
        return self.original != self.fixed

    def diff(self) -> str:
        return "".join(
            difflib.unified_diff(
                self.original.splitlines(keepends=True),
                self.fixed.splitlines(keepends=True),
                f"a/{self.path}",
                f"b/{self.path}",
            )
        )


class _OwnLineParen(cst.CSTTransformer):
    """``from x import (\n    a,\n    b,\n)`` keeps its closing parenthesis on a line of its own where the last
    names were removed (libcst's import removal drops the comma that carried the line break: ``a)``)."""

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        names = updated_node.names
        if (
            isinstance(names, cst.ImportStar)
            or updated_node.lpar is None
            or not isinstance(updated_node.lpar.whitespace_after, cst.ParenthesizedWhitespace)
            or not names
            or isinstance(names[-1].comma, cst.Comma)
            # (written `a\n)` with the parenthesis on its own line already: as it was)
            or (
                updated_node.rpar is not None
                and isinstance(updated_node.rpar.whitespace_before, cst.ParenthesizedWhitespace)
            )
        ):
            return updated_node
        broken = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(""))
        last = names[-1].with_changes(comma=cst.Comma(whitespace_after=broken))
        return updated_node.with_changes(names=[*names[:-1], last])


def migrate_source(
    code: str, path: str = "<string>", *, dispatch: Dispatch | None = None, target: str = "bridge"
) -> MigratedSource:
    """Scan ``code`` and compute its rewritten form (nothing is written).

    ``dispatch``: backend-dispatch helpers defined in other files being migrated with this one.
    ``target``: ``"bridge"`` (fsdp_bridge's calls) or ``"torch"`` (plain FSDP2 code, see ``_torch_target``).
    """
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: allowed {', '.join(TARGETS)}; pass --target bridge or --target torch")
    wrapper = parsed(code)  # the tree-wide analyses' wrapper of this text, its metadata resolved once
    module = wrapper.module
    collector = Collector()
    wrapper.module.visit(collector)
    single = {k: v[0] for k, v in collector.assigned.items() if len(v) == 1}
    known = Dispatch()
    if dispatch is not None:
        known.merge(dispatch)
    if own_twice := set(top_level_functions(code)) & known.defined_twice:
        # A call of this file reaches this file's own function of that name, and another file's call of the
        # name may reach another file's (three training scripts, each with its own setup_model): what other files
        # showed of the name (its parameters handed an FSDP1 model, its result one) is not this function's.
        known.fsdp1_args = {a for a in known.fsdp1_args if a.split(":", 1)[0] not in own_twice}
        known.fsdp1_results = {k: v for k, v in known.fsdp1_results.items() if k not in own_twice}
        for _ in range(4):  # this file's own evidence again, down its calls (main -> validation_step -> evaluate)
            before = (set(known.fsdp1_args), {k: set(v) for k, v in known.fsdp1_results.items()})
            known.merge(find_fsdp1_arguments(wrapper, known))
            if (known.fsdp1_args, known.fsdp1_results) == before:
                break
    for cls in set(top_level_classes(code)) & known.classes_twice:
        if cls in known.base_imports and not known.base_imports[cls] & module_suffixes(path, [cls]):
            # subclasses hand their model to another file's class of this name (``super().__init__(model=...)``
            # with that one imported)
            known.fsdp1_args = {a for a in known.fsdp1_args if a.split(":", 1)[0] != cls}
    if "FSDPModule" in code:
        known.merge(find_dispatch(wrapper))
    if "FullyShardedDataParallel" in code:
        known.merge(find_fsdp1_arguments(wrapper, known))
    known.merge(
        Dispatch(
            own_methods=find_own_methods(code, path),
            makes_state_dict_context=path if finds_state_dict_context(code) else None,
            group_fsdp=path if passes_group(code) else None,
            offloads_params=path if offloads_params(code) else None,
            mixed_precision=path if passes_mixed_precision(code) else None,
            asks_backend=path if asks_backend(code) else None,
            subclasses_fsdp1=path if subclasses_wrapper(code) else None,
            wraps_fsdp1=path if names_wrapper(code) else None,
            constructs_fsdp1=path if constructs_wrapper(code) else None,
            tests_lightning_strategy=path if tests_lightning_strategy(code) else None,
            subclassed=subclassed_names(code),
        )
    )
    if passes_group(code):
        known.group_fsdp = path  # this file's own, named first
    if bridge_set_state_dict_type(code):
        known.bridge_sets_state_dict_type = OWN_FILE
    followed = known.bridge_sets_state_dict_type is not None
    if unfollowed_set_state_dict_type(code, sharded_followed=followed) or (
        "set_state_dict_type" in known.own_methods and self_spelled_set_state_dict_type(code)
    ):
        known.unfollowed_set_state_dict_type = OWN_FILE
    if calls_set_state_dict_type(code):
        # this file's own call, named before another file's (not by its path: the TODO then reads the same
        # whichever directory the tree is given as, so a second --fix adds none)
        known.sets_state_dict_type = OWN_FILE
    uses = dict(collector.uses)
    for stmt in module.body:  # a module-level variable another file imports: a use the file does not show
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
            var = cast(cst.Name, cast(cst.Assign, cast(cst.SimpleStatementLine, stmt).body[0]).targets[0].target)
            if var.value in known.imported_names:
                uses[var.value] = uses.get(var.value, 0) + 1
    scan = Scanner(path, code, single, uses, known)
    scan.target = target
    scan.aliases = with_reexports(wrapper, class_aliases(wrapper), known.reexports)
    wrapper.visit(scan)  # plan: FSDP(...) conversions and checkpoint blocks
    scan.settle_inlined()
    scan.planning = False
    wrapper.visit(scan)  # report: every other construct
    scan.settle_duck_tests()
    vendored = vendored_torch_module(code, path) if scan.findings else None
    if vendored is not None:  # a copy of torch's own code that touches FSDP1: one construct, left as it is
        finding = CodeFinding(path, 1, 0, vendored.construct, vendored.replacement, False)
        comment = f"# {TODO}: {vendored.construct}: {vendored.replacement}\n"
        head, _, rest = code.partition("\n") if code.startswith("#!") else ("", "", code)
        noted = code if comment in code else (f"{head}\n" if head else "") + comment + rest
        return MigratedSource(path, code, noted, [finding])
    if not scan.uses_fsdp1 and not scan.fsdp1_elsewhere and not scan.rewrites_backend and not scan.rewrites_names:
        # At most config-driven FSDP (Trainer / accelerate arguments): report, change nothing; under
        # --target torch, code on the bridge already (an earlier --fix) is lowered.
        if target == "torch" and "fsdp_bridge." in code:
            return _lowered(
                module,
                code,
                path,
                list(scan.findings),
                groups=known.group_fsdp is not None,
                spans={},
                typed=known.sets_state_dict_type is not None,
                kept=known.keeps_fsdp1 is not None or scan.blocked_choice or known.subclasses_fsdp1 is not None,
            )
        return MigratedSource(path, code, code, sorted(scan.findings, key=lambda f: (f.line, f.column)))
    # torch's state-dict functions under another name where the file defines (or imports) its own of that name
    renamed = {n: f"torch_{n}" for n in sorted(scan.needs_state_dict_api) if _binds_own(module, n)}
    fixer = Rewriter(scan, {id(v): k for k, v in single.items()}, renamed)
    fixed = wrapper.module.visit(fixer)
    fixed, alias_findings = _settle_aliases(fixed, scan.aliases, known.imported_names, path)
    scan.findings.extend(alias_findings)
    if fixed.code != code:
        context = CodemodContext()
        if (scan.conversions or scan.fixable_calls) and _names_bridge(fixed):
            AddImportsVisitor.add_needed_import(context, "fsdp_bridge")
        for name in sorted(scan.needs_state_dict_api):
            if not _used_here(fixed, renamed.get(name, name)):
                continue  # planned for a rewrite that was not made (its construct stayed a TODO)
            AddImportsVisitor.add_needed_import(
                context, "torch.distributed.checkpoint.state_dict", name, asname=renamed.get(name)
            )
        for module_name, obj in sorted(scan.needs_imports, key=str):
            AddImportsVisitor.add_needed_import(context, module_name, obj)
        fixed = AddImportsVisitor(context).transform_module(fixed)
        kept = _kept_fsdp2_imports(module)
        in_strings = _string_text(fixed)
        taken = _taken_by_other_files(path, known.from_imports)
        for imp in _fsdp_imports(fixed):
            if (imp[2] or imp[1]) in taken or "*" in taken:
                if not _used_here(fixed, imp[2] or imp[1] or ""):  # kept for the other file alone: said
                    scan.findings.append(_kept_import_finding(path, module, imp, "*" in taken))
                continue
            if imp not in kept and not re.search(rf"\b{re.escape(imp[2] or imp[1] or '')}\b", in_strings):
                # (a name written in a string stays imported: eval(f"ShardingStrategy.{name}") reads it)
                RemoveImportsVisitor.remove_unused_import(context, *imp)
        if scan.consumed_partial:
            RemoveImportsVisitor.remove_unused_import(context, "functools")
        for module_name, obj, alias in sorted(scan.lightning_drops, key=str):
            RemoveImportsVisitor.remove_unused_import(context, module_name, obj, alias)
        fixed = RemoveImportsVisitor(context).transform_module(fixed).visit(_OwnLineParen())
        fixed = _imports_after_setup(fixed, module)
        fixed = _comments_of_removed_imports(module, fixed)
        fixed = _no_new_blank_after_headers(code, fixed)
        left = set(_fsdp_imports(fixed))
        # the imports the file never used, gone with the others: said, as where nothing else changes
        scan.findings.extend(
            finding for imp, finding in _unused_fsdp1_imports(module, path, known.from_imports) if imp not in left
        )
    elif unused := _unused_fsdp1_imports(module, path, known.from_imports):
        # nothing else to rewrite: FSDP1 imports the file never used are all that ties it to FSDP1
        context = CodemodContext()
        for imp, finding in unused:
            RemoveImportsVisitor.remove_unused_import(context, *imp)
            scan.findings.append(finding)
        fixed = RemoveImportsVisitor(context).transform_module(fixed).visit(_OwnLineParen())
        fixed = _comments_of_removed_imports(module, fixed)
        fixed = _no_new_blank_after_headers(code, fixed)
    findings = sorted(scan.findings, key=lambda f: (f.line, f.column))
    if target == "torch" and "fsdp_bridge." in fixed.code:
        positions = wrapper.resolve(PositionProvider)
        spans = {
            (r.start.line, r.start.column): (r.end.line, r.end.column)
            for node, r in positions.items()
            if id(node) in scan.conversions
        }
        return _lowered(
            fixed,
            code,
            path,
            findings,
            groups=known.group_fsdp is not None,
            spans=spans,
            typed=known.sets_state_dict_type is not None,
            kept=known.keeps_fsdp1 is not None or scan.blocked_choice or known.subclasses_fsdp1 is not None,
        )
    return MigratedSource(path, code, fixed.code, findings)


def _keeps_chosen_constructor(code: str, path: str) -> bool:
    """The file calls FSDP1's class picked by a conditional expression (``(FSDP if ok else X)(m)``) that the
    rewrite leaves as written (its arguments block the bridge's call): the model it makes stays FSDP1's."""
    return chooses_wrapper(code) and KEPT_CONSTRUCTOR in migrate_source(code, path).fixed


def _settle_aliases(
    fixed: cst.Module, aliases: ClassAliases, imported: set[str], path: str
) -> tuple[cst.Module, list[CodeFinding]]:
    """After the rewrite: remove each alias of FSDP1's class (``FSDP = FullyShardedDataParallel``) no code
    uses any more, and report each, removed or kept (still used here, or a name another file imports)."""
    if not aliases.assignments:
        return fixed, []
    collector = Collector()
    fixed.visit(collector)
    findings: list[CodeFinding] = []
    removable: set[tuple[str, str]] = set()
    flagged: dict[tuple[str, str], str] = {}
    for name, line, value in aliases.assignments.values():
        construct = f"{name} = {value} (an alias of FSDP1's wrapper class)"
        bound = sum(1 for v in aliases.assignments.values() if v[0] == name)
        if name in imported:
            text = (
                f"kept: a file of this tree imports a name {name}, perhaps this one: calls through it there are "
                "not followed; import the class there under that name (from torch.distributed.fsdp import "
                f"FullyShardedDataParallel as {name}) and run migrate code again"
            )
            flagged[(name, value)] = f"# {TODO}: {construct}: {text}"
            findings.append(CodeFinding(path, line, 0, construct, text, False))
        elif collector.uses.get(name, 0) > bound or (
            "__all__" in fixed.code and (f'"{name}"' in fixed.code or f"'{name}'" in fixed.code)
        ):
            text = (
                f"kept: {name} is still used by code left as it is (each use is listed on its own line); calls "
                "through it are migrated as through an import alias"
            )
            findings.append(CodeFinding(path, line, 0, construct, text, True))
        else:
            removable.add((name, value))
            text = f"removed: no use of {name} remains (calls through it were migrated as through an import alias)"
            findings.append(CodeFinding(path, line, 0, construct, text, True))
    if not removable and not flagged:
        return fixed, findings

    def alias_of(stmt: cst.BaseStatement) -> tuple[str, str] | None:
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
            assign = cast(cst.Assign, cast(cst.SimpleStatementLine, stmt).body[0])
            return cast(cst.Name, assign.targets[0].target).value, code_of(assign.value)
        return None

    class Settle(cst.CSTTransformer):
        def _body(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
            out = []
            for stmt in body:
                key = alias_of(stmt)
                if key in removable:
                    continue
                if key is not None and key in flagged:
                    stmt = cast(cst.SimpleStatementLine, stmt)
                    comments = {line.comment.value for line in stmt.leading_lines if line.comment is not None}
                    if flagged[key] not in comments:
                        stmt = stmt.with_changes(
                            leading_lines=[*stmt.leading_lines, cst.EmptyLine(comment=cst.Comment(flagged[key]))]
                        )
                out.append(stmt)
            return out

        def leave_IndentedBlock(
            self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
        ) -> cst.IndentedBlock:
            body = self._body(updated_node.body)
            return updated_node.with_changes(body=body) if body else updated_node

        def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
            return updated_node.with_changes(body=self._body(updated_node.body))

    return fixed.visit(Settle()), findings


def _lowered(
    fixed: cst.Module,
    code: str,
    path: str,
    findings: list[CodeFinding],
    *,
    groups: bool,
    spans: dict[tuple[int, int], tuple[int, int]],
    typed: bool = False,
    kept: bool = False,
) -> MigratedSource:
    """``--target torch``: the bridge rewrite ``fixed`` of ``code`` lowered to plain torch; each report line
    at its place in ``code``, naming what the written file holds (``_torch_report``)."""
    lowered = lower_to_torch(fixed, path, groups=groups, typed=typed, kept=kept)
    findings = torch_findings(path, code, fixed.code, findings, lowered.calls, spans)
    written = _imports_after_setup(lowered.module, cst.parse_module(code))
    return MigratedSource(path, code, written.code, findings, lowered.uses_helpers)


def _comments_of_removed_imports(original: cst.Module, fixed: cst.Module) -> cst.Module:
    """The comment lines above a top-level import the rewrite removed (an FSDP1 import no use is left of),
    put back below the nearest statement above it that is still there: they may be the user's notes or
    commented-out code, not the import's."""
    text = fixed.code
    body = list(fixed.body)
    bare = [fixed.code_for_node(s.with_changes(leading_lines=())).strip() for s in body]
    moved: dict[int, list[cst.EmptyLine]] = {}
    for i, stmt in enumerate(original.body):
        if not _is_import(stmt) or not isinstance(stmt, cst.SimpleStatementLine):
            continue
        if not any(line.comment is not None and line.comment.value not in text for line in stmt.leading_lines):
            continue
        at = 0  # after the nearest statement above that is still there (else at the top)
        for earlier in reversed(original.body[:i]):
            code = original.code_for_node(earlier.with_changes(leading_lines=())).strip()
            if code in bare:
                at = bare.index(code) + 1
                break
        if at < len(body):
            moved.setdefault(at, []).extend(stmt.leading_lines)
    if not moved:
        return fixed
    for at, lines in moved.items():
        body[at] = body[at].with_changes(leading_lines=(*lines, *body[at].leading_lines))
    return fixed.with_changes(body=body)


def _no_new_blank_after_headers(code: str, fixed: cst.Module) -> cst.Module:
    """Blank lines the removal of a block's first statement left at the block's start (a local import, then
    a blank line, in ``if cfg.use_fp16:``), or at the top of the file, go; a header the original follows with a
    blank line keeps it."""
    before = code.split("\n")
    kept = {
        line.strip() for line, after in itertools.pairwise(before) if line.rstrip().endswith(":") and not after.strip()
    }
    lines = fixed.code.split("\n")
    out: list[str] = []
    for line in lines:
        if not line.strip() and out and out[-1].rstrip().endswith(":") and out[-1].strip() not in kept:
            header = out[-1].split("#", 1)[0].rstrip()
            if header.endswith(":") and header.lstrip().split(" ", 1)[0] in _BLOCK_KEYWORDS:
                continue
        out.append(line)
    text = "\n".join(out)
    if before[0].strip() and not out[0].strip():
        text = text.lstrip("\n")  # the file's first statement removed: no blank line left at its top
    if text == fixed.code:
        return fixed
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError:  # a header-like line inside a string: leave the text as it was
        return fixed


_BLOCK_KEYWORDS = frozenset(
    {"if", "elif", "else:", "else", "for", "while", "with", "try:", "try", "except", "except:", "finally:"}
    | {"def", "class", "async"}
)


def _imports_torch(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        (isinstance(s, cst.Import) and any(code_of(a.name).split(".")[0] == "torch" for a in s.names))
        or (isinstance(s, cst.ImportFrom) and s.module is not None and code_of(s.module).split(".")[0] == "torch")
        for s in stmt.body
    )


def _is_import(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def _imports_after_setup(fixed: cst.Module, original: cst.Module) -> cst.Module:
    """The imports the rewrite added (``import fsdp_bridge``, torch's state-dict API), moved below the file's
    first import of torch when libcst put them above statements that run before it: ``os.environ[...] = ...``
    set before ``import torch`` (thread counts, allocator settings) must still come before torch is imported,
    and ``import fsdp_bridge`` imports torch."""
    had = Counter(original.code_for_node(s).strip() for s in original.body if _is_import(s))
    body = list(fixed.body)
    added = set()
    for i in reversed(range(len(body))):  # of a repeated import, the file's own is the last: libcst adds above
        if _is_import(body[i]):
            text = fixed.code_for_node(body[i]).strip()
            if had[text] > 0:
                had[text] -= 1
            else:
                added.add(i)
    own = {fixed.code_for_node(s).strip() for i, s in enumerate(body) if _is_import(s) and i not in added}
    if any(fixed.code_for_node(body[i]).strip() in own for i in added):  # the file imports it already, below
        body = [s for i, s in enumerate(body) if i not in added or fixed.code_for_node(s).strip() not in own]
        return _imports_after_setup(fixed.with_changes(body=body), original)
    first = next((i for i, s in enumerate(body) if i not in added and _imports_torch(s)), None)
    setup = first is None  # the file's torch imports were all FSDP1's, removed: below what ran before them
    if setup:
        start = next((i for i, s in enumerate(original.body) if _imports_torch(s)), None)
        ran = [original.code_for_node(s).strip() for s in original.body[:start] if not _is_import(s)] if start else []
        marks = [i for i, s in enumerate(body) if ran and i not in added and fixed.code_for_node(s).strip() == ran[-1]]
        first = marks[0] if marks else None
    early = sorted(i for i in added if first is not None and i < first)
    if first is None or not early or (not setup and all(_is_import(body[j]) for j in range(early[0], first))):
        return fixed
    end = first
    while end + 1 < len(body) and _is_import(body[end + 1]):
        end += 1  # after the block of imports torch's opens
    moved = [body[i] for i in early]
    # libcst set a blank line before the statement its imports preceded (``matplotlib.use(...)`` after ``import
    # matplotlib``): with the imports gone from there, that statement gets back the lines it had
    had_lines = {
        original.code_for_node(s).strip(): s.leading_lines for s in original.body if hasattr(s, "leading_lines")
    }
    for i in {i + 1 for i in early} - set(early):
        if i < len(body) and hasattr(body[i], "leading_lines"):
            was = had_lines.get(fixed.code_for_node(body[i].with_changes(leading_lines=())).strip())
            if was is not None:
                body[i] = body[i].with_changes(leading_lines=was)
    kept = [s for i, s in enumerate(body) if i not in early]
    at = kept.index(body[end]) + 1
    return fixed.with_changes(body=[*kept[:at], *moved, *kept[at:]])


FSDP2_NAMES = frozenset(
    {"FSDPModule", "fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy", "UnshardHandle"}
)
"""FSDP2's own names in ``torch.distributed.fsdp``: the codemod removes an import of one only where its
rewrite took away the uses."""


def _kept_fsdp2_imports(module: cst.Module) -> set[tuple[str, str | None, str | None]]:
    """Imports of FSDP2's names that ``module`` never used before the rewrite: kept (often there for another
    file, ``from .utils import MixedPrecisionPolicy``, or for a branch on the torch version)."""
    candidates = [imp for imp in _fsdp_imports(module) if str(imp[1]).rsplit(".", 1)[-1] in FSDP2_NAMES]
    if not candidates:
        return set()
    context = CodemodContext()
    for imp in candidates:
        RemoveImportsVisitor.remove_unused_import(context, *imp)
    left = set(_fsdp_imports(RemoveImportsVisitor(context).transform_module(module)))
    return {imp for imp in candidates if imp not in left}


def _string_text(module: cst.Module) -> str:
    """The text of the string literals (f-strings' literal parts too) ``eval(...)`` / ``exec(...)`` calls of
    ``module`` run, one per line: names written there are read when the code runs."""
    parts: list[str] = []

    class V(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if m.matches(node.func, m.Name("eval") | m.Name("exec")):
                for n in walk(node):
                    if isinstance(n, (cst.SimpleString, cst.FormattedStringText)):
                        parts.append(n.value)

    module.visit(V())
    return "\n".join(parts)


def _names_bridge(module: cst.Module) -> bool:
    """The rewritten code reads the name ``fsdp_bridge`` (TODO comments that mention it aside)."""
    return any(isinstance(n, cst.Name) and n.value == "fsdp_bridge" for n in walk(module))


def _used_here(module: cst.Module, name: str) -> bool:
    """``name`` is read by the module's code (its import statements aside)."""
    imports = {id(n) for i in walk(module) if isinstance(i, (cst.Import, cst.ImportFrom)) for n in walk(i)}
    return any(isinstance(n, cst.Name) and n.value == name and id(n) not in imports for n in walk(module))


def _taken_by_other_files(path: str, tree_imports: set[str]) -> set[str]:
    """The names of this file other files of the tree import from it (``"*"`` for a star import)."""
    if not tree_imports:
        return set()
    parts = [p for p in Path(path).with_suffix("").parts if p not in ("/", "")]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    prefixes = {".".join(parts[-k:]) + "." for k in range(1, min(len(parts), 6) + 1)}
    return {imp.rsplit(".", 1)[1] for imp in tree_imports if imp.rsplit(".", 1)[0] + "." in prefixes}


def _unused_fsdp1_imports(
    module: cst.Module, path: str, tree_imports: set[str]
) -> list[tuple[tuple[str, str | None, str | None], CodeFinding]]:
    """FSDP1's names a file imports and never uses (nor names in an ``eval`` string, nor hands to another file of
    the tree, nor re-exports from a package's ``__init__``): each with its report line. Such an import is all that
    ties the file to FSDP1, whose module torch is removing: ``--fix`` drops it."""
    if Path(path).name == "__init__.py":
        return []
    taken = _taken_by_other_files(path, tree_imports)
    in_strings = _string_text(module)
    strings = {n.evaluated_value for n in walk(module) if isinstance(n, cst.SimpleString)}  # __all__ entries
    plain: list[cst.CSTNode] = []  # statements of the module and of function and class bodies, nothing guarded

    def collect(body: Sequence[cst.BaseStatement]) -> None:
        for stmt in body:
            if isinstance(stmt, cst.SimpleStatementLine):
                plain.append(stmt)
            elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and isinstance(stmt.body, cst.IndentedBlock):
                collect(stmt.body.body)

    collect(module.body)
    unguarded = _fsdp_imports(cst.Module(body=cast("list[cst.SimpleStatementLine]", plain)))
    lines = _import_lines(module)
    found = []
    for imp in _fsdp_imports(module):
        name = imp[2] or imp[1] or ""
        if (
            imp not in unguarded  # under try / if: a feature probe (try: import X; HAS_X = True), kept
            or name in strings
            or not imp[0].startswith("torch.distributed.fsdp")
            or str(imp[1]).rsplit(".", 1)[-1] in FSDP2_NAMES
            or name in taken
            or "*" in taken
            or _used_here(module, name)
            or re.search(rf"\b{re.escape(name)}\b", in_strings)
        ):
            continue
        line = lines[imp].pop(0) if lines.get(imp) else 1
        construct = f"from {imp[0]} import {imp[1]}{f' as {imp[2]}' if imp[2] else ''} (never used here)"
        found.append((imp, CodeFinding(path, line, 0, construct, "removed: the file uses nothing of it", True)))
    return found


def _import_lines(module: cst.Module) -> dict[tuple[str, str | None, str | None], list[int]]:
    """(module, name, alias) of each ``from ... import`` name -> the lines the name is written on, in order (a
    name of a parenthesized import on its own line; a name imported twice, both)."""
    wrapper = cst.MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    found: dict[tuple[str, str | None, str | None], list[int]] = {}
    for node in walk(wrapper.module):
        if not isinstance(node, cst.ImportFrom) or node.module is None or isinstance(node.names, cst.ImportStar):
            continue
        for alias in node.names:
            asname = alias.asname.name if alias.asname is not None else None
            key = (code_of(node.module), code_of(alias.name), code_of(asname) if asname is not None else None)
            found.setdefault(key, []).append(positions[alias].start.line)
    return found


def _kept_import_finding(
    path: str, module: cst.Module, imp: tuple[str, str | None, str | None], star: bool
) -> CodeFinding:
    """The report line of an FSDP1 import kept because another file of the tree takes the name from here."""
    name = imp[2] or imp[1] or ""
    lines = [
        (i, text)
        for i, text in enumerate(module.code.splitlines(), 1)
        if re.match(rf"\s*from\s+{re.escape(imp[0])}\s+import\b", text)
    ]
    line = next(
        (i for i, text in lines if re.search(rf"\b{re.escape(imp[1] or '')}\b", text)), lines[0][0] if lines else 1
    )
    how = "imports everything from this module (import *)" if star else f"imports {name} from this module"
    uses = (
        "its uses there are migrated as FSDP1's class (FSDP.state_dict_type, FSDP.optim_state_dict, ...), and the "
        "import stays for that file's import of it"
        if imp[1] == "FullyShardedDataParallel" and not star
        else "read its uses there yourself (they are not reported)"
    )
    return CodeFinding(
        path,
        line,
        0,
        f"from {imp[0]} import {imp[1]}{f' as {imp[2]}' if imp[2] else ''}",
        f"kept: another file of the tree {how} and may use FSDP1's {name} from here; {uses}",
        True,
        note=True,
    )


def _fsdp_imports(module: cst.Module) -> list[tuple[str, str | None, str | None]]:
    """Every ``from torch.distributed.fsdp... import X`` and ``import torch.distributed.fsdp.<module> as X``
    (removed by the codemod only when unused)."""
    found: list[tuple[str, str | None, str | None]] = []

    class V(cst.CSTVisitor):
        def visit_Import(self, node: cst.Import) -> None:
            for alias in node.names:
                mod = code_of(alias.name)
                if (
                    mod.startswith("torch.distributed.fsdp.")
                    and alias.asname
                    and isinstance(alias.asname.name, cst.Name)
                ):
                    found.append((mod, None, alias.asname.name.value))

        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            mod = code_of(node.module) if node.module else ""
            if not (
                mod.startswith("torch.distributed.fsdp")
                or mod in ("functools", "torch.distributed.checkpoint.optimizer")
            ) or isinstance(node.names, cst.ImportStar):
                return
            for alias in node.names:
                asname = alias.asname.name.value if alias.asname and isinstance(alias.asname.name, cst.Name) else None
                found.append((mod, code_of(alias.name), asname))

    module.visit(V())
    return found


NOTEBOOK = (
    "a Jupyter notebook using FSDP1 (FullyShardedDataParallel): notebooks are not rewritten; export it to a "
    "script (jupyter nbconvert --to script), migrate that, and paste the cells back"
)


def migrate_paths(
    paths: Sequence[str | Path], *, fix: bool = False, target: str = "bridge"
) -> tuple[CodeReport, list[MigratedSource]]:
    """Scan files (directories: every ``*.py`` below); with ``fix``, write the rewrites.

    ``target="torch"`` writes plain FSDP2 code, and ``_fsdp2_helpers.py`` beside the files that use it
    (one more result, listed as changed; a file of that name that the codemod did not write is never
    overwritten: the files that would import it are skipped instead).

    Never raises for a file's content: a file that cannot be read, parsed or rewritten
    (not UTF-8, not valid Python, a construct the codemod cannot handle) is left untouched
    and listed in ``report.skipped`` with the reason.  With ``fix`` the rewrite is all or
    nothing: every new file is written beside its original first, then all are moved into
    place; if any write fails, nothing is changed.
    """
    files: list[Path] = []
    shown: dict[Path, str] = {}  # how a TODO names another file: relative to the directory given, so the
    for p in map(Path, paths):  # comments do not change with the working directory (a second --fix adds none)
        found = sorted(f for f in p.rglob("*.py") if f.is_file()) if p.is_dir() else [p]
        files.extend(found)
        shown.update({f: f.relative_to(p).as_posix() if p.is_dir() else f.name for f in found})
    report = CodeReport()
    for p in map(Path, paths):  # notebooks are not rewritten: listed where they use FSDP1, so none is missed
        for nb in sorted(p.rglob("*.ipynb")) if p.is_dir() else ():
            if nb.is_file() and ".ipynb_checkpoints" not in nb.parts and notebook_uses_fsdp1(nb):
                report.skipped.append((str(nb), NOTEBOOK))
    results = []
    dispatch = Dispatch()  # helpers such as fsdp_version(model) may live in another file of the tree
    self_spelled: list[Path] = []  # files calling x.set_state_dict_type(x, ...)
    cited: str | None = None  # the file a TODO of a first --fix named as calling FSDP.set_state_dict_type
    unfollowed: list[tuple[str, bool, bool]] = []  # file, unfollowed alone, unfollowed in a tree the bridge's follow
    codes: dict[str, str] = {}
    for f in files:
        try:
            code = read_source(f)
            codes[str(f)] = code
            cited = cited or cited_set_state_dict_type(code)
            if "FSDPModule" in code:
                dispatch.merge(find_dispatch(parsed(code)))
            if "FullyShardedDataParallel" in code:
                wrapper = parsed(code)
                some, every = find_fsdp1_factories(wrapper, str(f))
                dispatch.merge(
                    Dispatch(
                        fsdp1_factories=some,
                        fsdp1_sure_factories=every,
                        fsdp1_attributes=find_fsdp1_attributes(wrapper),
                        instance_attributes=find_instance_attributes(wrapper),
                        fsdp1_predicates=find_fsdp1_predicates(wrapper, str(f)),
                        unit_holders=module_suffixes(str(f), find_unit_holders(wrapper)),
                    )
                )
                dispatch.merge(find_fsdp1_arguments(wrapper))
            copy = (
                vendored_torch_module(code, str(f))
                if "torch.distributed.fsdp" in code or "FullyShardedDataParallel" in code
                else None
            )
            # a copy of torch's own FSDP code says nothing of how the tree shards (its process groups, offload,
            # wraps): torch's code, often unused, left as it is
            ours = copy is None
            dispatch.merge(
                Dispatch(
                    imported_names=imported_names(code),
                    from_imports=from_imports(code),
                    reexports=fsdp1_class_reexports(code, str(f)),
                    own_methods=find_own_methods(code, str(f)),  # named relative to each caller
                    sets_state_dict_type=shown[f] if ours and calls_set_state_dict_type(code) else None,
                    bridge_sets_state_dict_type=shown[f] if bridge_set_state_dict_type(code) else None,
                    makes_state_dict_context=shown[f] if ours and finds_state_dict_context(code) else None,
                    group_fsdp=shown[f] if ours and passes_group(code) else None,
                    offloads_params=shown[f] if ours and offloads_params(code) else None,
                    mixed_precision=shown[f] if ours and passes_mixed_precision(code) else None,
                    asks_backend=shown[f] if ours and asks_backend(code) else None,
                    subclasses_fsdp1=shown[f] if ours and subclasses_wrapper(code) else None,
                    wraps_fsdp1=shown[f] if names_wrapper(code) else None,
                    constructs_fsdp1=shown[f] if ours and constructs_wrapper(code) else None,
                    keeps_fsdp1=shown[f] if ours and _keeps_chosen_constructor(code, str(f)) else None,
                    tests_lightning_strategy=shown[f] if tests_lightning_strategy(code) else None,
                    subclassed=subclassed_names(code),
                    data_swappers=find_data_swappers(code),
                    param_pairers=find_param_pairers(code),
                    own_attributes={n for n in INTERNAL_ATTRS if re.search(rf"\bself\.{n}\s*=[^=]", code)},
                )
            )
            unfollowed.append(
                (
                    shown[f],
                    unfollowed_set_state_dict_type(code),
                    unfollowed_set_state_dict_type(code, sharded_followed=True),
                )
            )
            if self_spelled_set_state_dict_type(code):
                self_spelled.append(f)
            if "torch.distributed.fsdp" in code and copy is not None:
                # an absolute ``torch.`` import is torch's own package, not a copy under third_party/torch/ (a
                # suffix of its path); only a copy at the tree's own root would shadow it
                copied = [
                    name
                    for name in module_suffixes(str(f), top_level_functions(code))
                    if not name.startswith("torch.") or shown[f].startswith("torch/")
                ]
                dispatch.merge(Dispatch(vendored_functions=dict.fromkeys(copied, str(f))))
        except Exception:  # unreadable or unparsable: reported by the loop below
            continue
    handed_across_files(codes, dispatch)
    defined = Counter(name for code in codes.values() for name in set(top_level_functions(code)))
    dispatch.defined_twice = {name for name, count in defined.items() if count > 1}
    classes = Counter(name for code in codes.values() for name in set(top_level_classes(code)))
    dispatch.classes_twice = {name for name, count in classes.items() if count > 1}
    del codes
    if cited is not None:
        # a first --fix may have deleted the call it named (a SHARDED_STATE_DICT statement): name it again
        dispatch.sets_state_dict_type = cited
    followed = dispatch.bridge_sets_state_dict_type is not None
    dispatch.unfollowed_set_state_dict_type = next(
        (name for name, alone, mixed in unfollowed if (mixed if followed else alone)), None
    )
    if self_spelled and "set_state_dict_type" in dispatch.own_methods:
        # x.set_state_dict_type(x, ...) may be the tree's own override: not rewritten, so nothing follows it
        dispatch.unfollowed_set_state_dict_type = dispatch.unfollowed_set_state_dict_type or shown[self_spelled[0]]
    for f in files:
        try:
            code = read_source(f)  # bounded in size and nesting before libcst sees it
        except SourceLimitError as err:
            report.skipped.append((str(f), str(err)))
            continue
        except (OSError, UnicodeDecodeError) as err:
            report.skipped.append((str(f), f"cannot be read as UTF-8 text ({err})"))
            continue
        if code.startswith(HELPERS_MARKER):
            continue  # the plain-torch helpers an earlier --target torch wrote: kept current below, not migrated
        try:
            result = migrate_source(code, str(f), dispatch=dispatch, target=target)
            if result.changed:
                cst.parse_module(result.fixed)  # the rewrite must parse, or the file is left alone
        except cst.ParserSyntaxError as err:
            report.skipped.append((str(f), f"not valid Python 3 ({str(err).splitlines()[0]})"))
            continue
        except Exception as err:  # a construct the codemod cannot handle: never a half-rewritten file
            report.skipped.append(
                (
                    str(f),
                    f"left untouched: the codemod failed on it ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''})",
                )
            )
            continue
        results.append(result)
        report.findings.extend(result.findings)
        if result.changed:
            report.changed.append(str(f))
        comments = (result.fixed if result.changed else code).count(f"# {TODO}")
        if comments:
            report.todo_comments[str(f)] = comments
    results.extend(_helper_modules(results, report))
    if fix:
        _write_all([r for r in results if r.changed])
    return report, results


def _helper_modules(results: list[MigratedSource], report: CodeReport) -> list[MigratedSource]:
    """``_fsdp2_helpers.py`` for each directory with a file that imports it (``--target torch``)."""
    out: list[MigratedSource] = []
    for folder in dict.fromkeys(Path(r.path).parent for r in results if r.uses_helpers):
        target = folder / f"{HELPERS_NAME}.py"
        try:
            existing = target.read_text(encoding="utf-8") if target.exists() else ""
        except (OSError, UnicodeDecodeError):
            existing = None
        if existing is None or (existing and not existing.startswith(HELPERS_MARKER)):
            # Someone's own file of that name: never overwritten; the files needing ours are left as they were.
            for r in results:
                if r.uses_helpers and Path(r.path).parent == folder:
                    r.fixed = r.original
                    report.changed = [c for c in report.changed if c != r.path]
                    report.skipped.append(
                        (r.path, f"left untouched: {target} exists and was not written by the codemod; rename it")
                    )
            continue
        out.append(MigratedSource(str(target), existing, HELPERS_SOURCE, []))
        if existing != HELPERS_SOURCE:
            report.changed.append(str(target))
    return out


def _write_all(results: Sequence[MigratedSource]) -> None:
    """Stage every rewritten file beside its original, then replace them all (all or nothing)."""
    staged: list[tuple[Path, Path]] = []
    try:
        for r in results:
            target = Path(r.path)
            tmp = target.with_name(f".{target.name}.fsdp-bridge-tmp")
            tmp.write_text(r.fixed, encoding="utf-8")
            if target.exists():
                shutil.copymode(target, tmp)
            staged.append((tmp, target))
    except OSError as err:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise MigrationWriteError(f"could not write beside {Path(r.path)} ({err}); no file was changed") from err
    for tmp, target in staged:
        os.replace(tmp, target)


class MigrationWriteError(OSError):
    """``--fix`` could not stage a rewritten file; nothing was changed."""


def _binds_own(module: cst.Module, name: str) -> bool:
    """The file binds ``name`` at module level to something other than torch's state-dict function of that name: a
    function or class of its own, an assignment, an import from another module (byodt's ``fsdp_utils.py`` defines
    ``get_model_state_dict(model, *, full)``, which the rewritten calls would have called)."""
    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value == name:
            return True
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Assign) and any(m.matches(t.target, m.Name(name)) for t in small.targets):
                return True
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                source = code_of(small.module) if small.module is not None else ""
                for alias in small.names:
                    bound = code_of(alias.asname.name) if alias.asname is not None else code_of(alias.name)
                    if bound == name and source != "torch.distributed.checkpoint.state_dict":
                        return True
    return False
