"""Text and syntax the rewrites produce: the ``fsdp_bridge.shard(...)`` call of a converted constructor,
its comments, and the TODO comments above statements."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import libcst as cst

from fsdp_bridge.migrate._analysis import Conversion, code_of
from fsdp_bridge.migrate._names import TODO


def with_option(options: str, extra: str) -> str:
    """``StateDictOptions(a=1)`` + ``strict=x`` -> ``StateDictOptions(a=1, strict=x)`` (also for
    ``fsdp_bridge.state_dict_options(...)``)."""
    head, _, _ = options.rpartition(")")
    return f"{head}{'' if head.endswith('(') else ', '}{extra})"


def runtime_names(runtime: Sequence[tuple[str, str]]) -> list[str]:
    """The arguments kept for ``from_fsdp1`` as the report names them (``**kwargs`` by its name)."""
    return [f"{kw}{code}" if kw in ("*", "**") else kw for kw, code in runtime]


def render_shard(conv: Conversion) -> cst.BaseExpression:
    """``fsdp_bridge.shard(module, fsdp_bridge.BridgeConfig(...)[, mesh=...])``, one argument per line
    when a single line would be long."""
    assert conv.module is not None
    if conv.runtime is not None:
        return render_runtime(conv)
    config = [(code_of(a.keyword), f"{code_of(a.keyword)}={code_of(a.value)}") for a in conv.config_args if a.keyword]
    tail = [f"mesh={code_of(conv.mesh)}"] if conv.mesh is not None else []
    one_line = (
        f"fsdp_bridge.shard({code_of(conv.module)}, fsdp_bridge.BridgeConfig({', '.join(c for _, c in config)})"
        + "".join(f", {t}" for t in tail)
        + ")"
    )
    if len(conv.indent) + len(one_line) <= 100 and not conv.slot_comments:
        return cst.parse_expression(one_line)

    # libcst adds the enclosing block's indentation to each continuation line.
    i1, i2 = "    ", "        "
    lines = [
        "fsdp_bridge.shard(",
        *commented(conv, i1, "module", code_of(conv.module)),
        f"{i1}fsdp_bridge.BridgeConfig(",
    ]
    for (slot, text), arg in zip(config, [a for a in conv.config_args if a.keyword], strict=True):
        if len(conv.indent) + len(i2) + len(text) >= 100 and isinstance(arg.value, cst.Dict) and arg.value.elements:
            # a long mapping (mixed_precision={...}) one entry per line
            entries = [
                f"{code_of(e.key)}: {code_of(e.value)}" if isinstance(e, cst.DictElement) else code_of(e).rstrip(", ")
                for e in arg.value.elements
            ]
            text = f"{slot}={{\n" + "".join(f"{i2}    {e},\n" for e in entries) + f"{i2}}}"
        lines += commented(conv, i2, slot, text)
    lines += [f"{i1}),"] + [x for t in tail for x in commented(conv, i1, "mesh", t)]
    lines += [i1 + c for c in conv.slot_comments.get("", ([], None))[0]] + [")"]
    return cst.parse_expression("\n".join(lines))


def comments_around(call: cst.Call, i: int) -> tuple[list[str], str | None]:
    """The comments on their own lines just before argument ``i`` of ``call``, and the one after it on
    its line (a rewrite that renders the arguments again keeps them in place)."""

    def own_lines(ws: object) -> list[str]:
        lines = getattr(ws, "empty_lines", ())
        return [line.comment.value for line in lines if line.comment is not None]

    def first(ws: object) -> str | None:
        line = getattr(ws, "first_line", None)
        return line.comment.value if line is not None and line.comment is not None else None

    lead: list[str] = []
    if i == 0:
        lead = own_lines(call.whitespace_before_args)
    else:
        prev = call.args[i - 1].comma
        if isinstance(prev, cst.Comma):
            lead = own_lines(prev.whitespace_after)
    a = call.args[i]
    trail = first(a.comma.whitespace_after) if isinstance(a.comma, cst.Comma) else first(a.whitespace_after_arg)
    return lead, trail


def closing_comments(call: cst.Call) -> list[str]:
    """The comments on their own lines after the last argument of ``call``, before its closing parenthesis
    (``# cpu_offload=CPUOffload(offload_params=True),`` left commented out at the end of a call)."""
    if not call.args:
        return []
    last = call.args[-1]
    ws = last.comma.whitespace_after if isinstance(last.comma, cst.Comma) else last.whitespace_after_arg
    return [line.comment.value for line in getattr(ws, "empty_lines", ()) if line.comment is not None]


def runtime_lines(conv: Conversion, indent: str) -> list[str]:
    """``kw=<as written>,`` lines for ``BridgeConfig.from_fsdp1(...)``, with the comments written
    around each argument; a value spanning lines keeps its shape, re-indented under its keyword."""
    lines: list[str] = []
    comments = conv.arg_comments if len(conv.arg_comments) == len(conv.runtime or []) else []
    for k, (kw, code) in enumerate(conv.runtime or []):
        lead, trail = comments[k] if comments else ([], None)
        lines.extend(indent + c for c in lead)
        first, *rest = (f"{kw}{code}" if kw in ("*", "**") else f"{kw}={code}").split("\n")
        rest = textwrap.dedent("\n".join(rest)).split("\n") if rest else []
        lines.append(indent + first)
        lines.extend(indent + line for line in rest)
        lines[-1] += "," + (f"  {trail}" if trail else "")
    return lines


def render_runtime(conv: Conversion) -> cst.BaseExpression:
    """``fsdp_bridge.shard(module, fsdp_bridge.BridgeConfig.from_fsdp1(kw=<as written>, ...)[, mesh=])``."""
    assert conv.module is not None and conv.runtime is not None
    i1, i2 = "    ", "        "
    lines = ["fsdp_bridge.shard(", *commented(conv, i1, "module", code_of(conv.module))]
    lines += [f"{i1}fsdp_bridge.BridgeConfig.from_fsdp1(", *runtime_lines(conv, i2), f"{i1}),"]
    if conv.mesh is not None:
        lines += commented(conv, i1, "mesh", f"mesh={code_of(conv.mesh)}")
    lines += [i1 + c for c in conv.slot_comments.get("", ([], None))[0]] + [")"]
    return cst.parse_expression("\n".join(lines))


def commented(conv: Conversion, indent: str, slot: str, text: str) -> list[str]:
    """``text,`` on a line of its own, with the comments written around the argument it came from."""
    lead, trail = conv.slot_comments.get(slot, ([], None))
    return [indent + c for c in lead] + [f"{indent}{text}," + (f"  {trail}" if trail else "")]


def commas(args: Sequence[cst.Arg]) -> list[cst.Arg]:
    out = []
    for i, a in enumerate(args):
        last = i == len(args) - 1
        out.append(
            a.with_changes(
                comma=cst.MaybeSentinel.DEFAULT if last else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            )
        )
    return out


def with_todos(original: Any, updated: Any, todos: dict[int, list[str]]) -> Any:
    texts = todos.get(id(original))
    if not texts:
        return updated
    mark = f"# {TODO}: "
    # what each TODO an earlier --fix wrote is about (its construct, before the first ": "): a second run keeps
    # that one, even where its reason reads differently now (the code around it was rewritten in between)
    written = {
        line.comment.value[len(mark) :].split(": ", 1)[0]
        for line in updated.leading_lines
        if line.comment is not None and line.comment.value.startswith(mark)
    }
    lines = list(updated.leading_lines)
    for text in dict.fromkeys(texts):
        if text.split(": ", 1)[0] not in written:
            lines.append(cst.EmptyLine(comment=cst.Comment(f"{mark}{text}")))
    return updated.with_changes(leading_lines=lines)
