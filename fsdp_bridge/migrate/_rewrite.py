"""Pass 2 of ``migrate code``: apply the rewrites the scanner planned, and write the TODO comments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import libcst as cst

from fsdp_bridge.migrate._analysis import code_of
from fsdp_bridge.migrate._render import commas, render_shard, with_todos
from fsdp_bridge.migrate._scanner import Scanner


class Rewriter(cst.CSTTransformer):
    """Pass 2: apply the planned rewrites and TODO comments."""

    def __init__(self, scan: Scanner, assignment_stmts: dict[int, str], renamed: dict[str, str] | None = None) -> None:
        super().__init__()
        self.scan = scan
        self.assignment_stmts = assignment_stmts  # id(value expr) -> name
        self.removed: dict[int, Any] = {}
        # torch's state-dict functions imported under another name where the file has its own of that name
        self.renamed = renamed or {}

    def _code(self, code: str) -> str:
        """A planned rewrite's text with torch's functions under the names this file imports them as: the calls
        the codemod writes (they pass ``options=``), not the file's own calls of its function of that name
        quoted inside them, nor strings."""
        if not self.renamed or not any(name in code for name in self.renamed):
            return code
        renamed = self.renamed

        class Rename(cst.CSTTransformer):
            def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
                func = updated_node.func
                if (
                    isinstance(func, cst.Name)
                    and func.value in renamed
                    and any(a.keyword is not None and a.keyword.value == "options" for a in updated_node.args)
                ):
                    return updated_node.with_changes(func=cst.Name(renamed[func.value]))
                return updated_node

        return cst.parse_module(code).visit(Rename()).code

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        rewrite = self.scan.call_rewrites.get(id(original_node))
        if rewrite is not None:
            return cst.parse_expression(self._code(rewrite))
        conv = self.scan.conversions.get(id(original_node))
        if conv is not None and not conv.blockers and id(original_node) in self.scan.chosen_calls:
            # (FSDP if ok else Plain)(m, ...) -> (fsdp_bridge.shard(m, ...) if ok else Plain(m, ...))
            chosen = updated_node.func
            assert isinstance(chosen, cst.IfExp)
            fsdp1_body = self.scan.chosen_calls[id(original_node)] == "body"
            other = updated_node.with_changes(
                func=(chosen.orelse if fsdp1_body else chosen.body).with_changes(lpar=[], rpar=[])
            )
            body, orelse = (render_shard(conv), other) if fsdp1_body else (other, render_shard(conv))
            return chosen.with_changes(body=body, orelse=orelse)
        if conv is not None and not conv.blockers:
            return render_shard(conv)
        kind = self.scan.fixable_calls.get(id(original_node))
        if kind is not None:
            func = updated_node.func
            if kind == "method" and isinstance(func, cst.Attribute):
                target = cst.parse_expression(f"fsdp_bridge.{func.attr.value}")
                if "\n" not in code_of(updated_node):
                    return updated_node.with_changes(
                        func=target, args=commas([cst.Arg(func.value), *updated_node.args])
                    )
                # arguments over several lines (comments among them): the object goes first, laid out as the
                # first argument was, and every argument stays as written
                first = cst.Arg(func.value, comma=cst.Comma(whitespace_after=updated_node.whitespace_before_args))
                return updated_node.with_changes(func=target, args=[first, *updated_node.args])
            kept = [
                a
                for a in updated_node.args
                if a.keyword is None or a.keyword.value != "recurse" or code_of(a.value) == "False"
            ]
            if kept and kept[0].keyword is not None and kept[0].keyword.value == "module":
                kept[0] = cst.Arg(kept[0].value, comma=kept[0].comma)  # FSDP1's module= by keyword: the model
            given = {a.keyword.value: code_of(a.value) for a in kept if a.keyword is not None}
            if "writeback" not in given and given.get("recurse") != "False" and given.get("rank0_only") != "True":
                # FSDP1's default writeback=True (the bridge's is False): changes made inside are kept, as there
                kept.append(
                    cst.Arg(
                        cst.Name("True"),
                        keyword=cst.Name("writeback"),
                        equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
                    )
                )
            return updated_node.with_changes(
                func=cst.parse_expression("fsdp_bridge.summon_full_params"), args=commas(kept)
            )
        if (added := self.scan.arg_adds.get(id(original_node))) is not None:
            return updated_node.with_changes(args=appended(updated_node, added))
        return updated_node

    def leave_Comparison(self, original_node: cst.Comparison, updated_node: cst.Comparison) -> Any:
        if (code := self.scan.expr_rewrites.get(id(original_node))) is not None:
            return cst.parse_expression(code)
        return updated_node

    def leave_SimpleString(self, original_node: cst.SimpleString, updated_node: cst.SimpleString) -> Any:
        if (code := self.scan.expr_rewrites.get(id(original_node))) is not None:
            return cst.parse_expression(code)  # another string, or what the string named (a strategy's class)
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> Any:
        if (code := self.scan.expr_rewrites.get(id(original_node))) is not None:
            return cst.parse_expression(self._code(code))
        rewrite = self.scan.name_rewrites.get(id(original_node))
        return cst.Name(rewrite) if rewrite else updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> Any:
        if id(original_node) in self.scan.attr_drops:
            return updated_node.value
        if id(original_node) in self.scan.attr_unwraps:  # X as rewritten inside it (a forwarded read dropped)
            return cst.Call(cst.parse_expression("fsdp_bridge.unwrapped"), [cst.Arg(updated_node.value)])
        if (code := self.scan.expr_rewrites.get(id(original_node))) is not None:
            return cst.parse_expression(self._code(code))
        rewrite = self.scan.name_rewrites.get(id(original_node))
        return cst.Name(rewrite) if rewrite else updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> Any:
        if id(original_node) in self.scan.removed_stmts:
            return self._remove(updated_node)
        if (code := self.scan.stmt_rewrites.get(id(original_node))) is not None:
            line = cst.parse_statement(self._code(code))
            rewritten = line.with_changes(
                leading_lines=updated_node.leading_lines, trailing_whitespace=updated_node.trailing_whitespace
            )
            return with_todos(original_node, rewritten, self.scan.todos)
        if len(original_node.body) == 1 and isinstance(original_node.body[0], cst.Assign):
            value = original_node.body[0].value
            if id(value) in self.scan.consumed_nodes and id(value) in self.assignment_stmts:
                return self._remove(updated_node)
        return with_todos(original_node, updated_node, self.scan.todos)

    def _remove(self, node: Any) -> Any:
        """Mark for removal; the enclosing block moves its comments to the next statement."""
        self.removed[id(node)] = node  # holding the node keeps its id unique until the block is rebuilt
        return node

    def _reorder(self, original_body: Sequence[Any], body: Sequence[Any]) -> list[Any]:
        """Apply planned optimizer moves (original and updated bodies align one to one)."""
        if not self.scan.optimizer_moves or len(original_body) != len(body):
            return list(body)
        ids = [id(s) for s in original_body]
        moving = {i for i, sid in enumerate(ids) if sid in self.scan.optimizer_moves}
        if not moving:
            return list(body)
        out: list[Any] = []
        for i, stmt in enumerate(body):
            if i in moving:
                continue
            out.append(stmt)
            out.extend(body[k] for k in sorted(moving) if self.scan.optimizer_moves[ids[k]] == ids[i])
        return out

    def _drop_removed(self, body: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        carry: list[list[cst.EmptyLine]] = []  # the leading lines of each statement removed since the last kept
        for stmt in body:
            if id(stmt) in self.removed and self.removed[id(stmt)] is stmt:
                del self.removed[id(stmt)]
                carry.append(list(stmt.leading_lines))
                continue
            if carry:
                stmt = stmt.with_changes(leading_lines=_joined_gaps([*carry, list(stmt.leading_lines)]))
                carry = []
            out.append(stmt)
        return out

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> Any:
        body = self._drop_removed(self._reorder(original_node.body, updated_node.body))
        return updated_node.with_changes(body=body or [cst.SimpleStatementLine([cst.Pass()])])

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._drop_removed(self._reorder(original_node.body, updated_node.body)))

    def _compound(self, original_node: Any, updated_node: Any) -> Any:
        return with_todos(original_node, updated_node, self.scan.todos)

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> Any:
        if (code := self.scan.stmt_rewrites.get(id(original_node))) is not None:
            return cst.parse_statement(self._code(code)).with_changes(leading_lines=updated_node.leading_lines)
        return self._compound(original_node, updated_node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> Any:
        return self._compound(original_node, updated_node)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> Any:
        return self._compound(original_node, updated_node)

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> Any:
        if (code := self.scan.stmt_rewrites.get(id(original_node))) is not None:
            return cst.parse_statement(self._code(code)).with_changes(leading_lines=updated_node.leading_lines)
        return self._compound(original_node, updated_node)

    def leave_While(self, original_node: cst.While, updated_node: cst.While) -> Any:
        return self._compound(original_node, updated_node)

    def leave_With(self, original_node: cst.With, updated_node: cst.With) -> Any:
        if id(original_node) in self.scan.unwrap_withs and isinstance(updated_node.body, cst.IndentedBlock):
            # The block's body, one level out (its statements were rewritten inside it).
            body: list[Any] = list(updated_node.body.body)
            body[0] = body[0].with_changes(leading_lines=[*updated_node.leading_lines, *body[0].leading_lines])
            return cst.FlattenSentinel(body)
        return self._compound(original_node, updated_node)


def _blank_run(lines: Sequence[cst.EmptyLine]) -> int:
    """The longest run of blank lines (no comment) in ``lines``."""
    longest = run = 0
    for line in lines:
        run = run + 1 if line.comment is None else 0
        longest = max(longest, run)
    return longest


def _joined_gaps(gaps: Sequence[Sequence[cst.EmptyLine]]) -> list[cst.EmptyLine]:
    """The leading lines of a kept statement after the statements before it were removed: their lines and its own
    (comments kept), no run of blank lines longer than the longest in any one of them (a removed statement
    between two blank lines leaves one gap, not two)."""
    limit = max(_blank_run(gap) for gap in gaps)
    out: list[cst.EmptyLine] = []
    run = 0
    for line in (line for gap in gaps for line in gap):
        run = run + 1 if line.comment is None else 0
        if run <= limit:
            out.append(line)
    return out


def appended(call: cst.Call, added: str) -> list[cst.Arg]:
    """``call``'s arguments with the argument ``added`` (its source, ``name=value``) last, laid out as the others
    are: one per line where they are (no comment of theirs repeated), a trailing comma kept."""
    arg = cst.ensure_type(cst.parse_expression(f"f({added})"), cst.Call).args[0]
    if not call.args:
        return [arg]
    *head, last = call.args
    spaces = [a.comma.whitespace_after for a in head if isinstance(a.comma, cst.Comma)]
    spaces.append(call.whitespace_before_args)
    lines = next((w for w in spaces if isinstance(w, cst.ParenthesizedWhitespace)), None)
    between = cst.Comma(
        whitespace_after=cst.SimpleWhitespace(" ")
        if lines is None
        else cst.ParenthesizedWhitespace(indent=lines.indent, last_line=lines.last_line)  # a newline, the indent
    )
    if isinstance(last.comma, cst.Comma):  # a trailing comma: the new argument takes it
        return [*head, last.with_changes(comma=between), arg.with_changes(comma=last.comma)]
    # the space before ")" (a newline there) goes after the new argument
    closing = last.whitespace_after_arg
    return [
        *head,
        last.with_changes(comma=between, whitespace_after_arg=cst.SimpleWhitespace("")),
        arg.with_changes(whitespace_after_arg=closing),
    ]
