"""DCP's ``.metadata`` read without :mod:`pickle`: a small bounded interpreter of its opcodes.

``dcp.save`` writes the checkpoint's metadata as a pickle. Unpickling runs whatever the file
names; even an unpickler that only resolves allow-listed classes still lets ``BUILD`` set
attributes on a class (``PosixPath.is_relative_to = ...`` for the rest of the process) and lets
memo references make a 700-byte file hash for ever. So the bytes are never given to
:mod:`pickle`. :func:`parse_dcp_metadata` walks them with :func:`pickletools.genops` (which
only decodes opcodes) and builds the result itself:

* no global is ever looked up: ``GLOBAL``/``STACK_GLOBAL`` push a name token, which is only
  accepted as the class of ``NEWOBJ`` (DCP's metadata dataclasses) or the callable of ``REDUCE``
  (``torch.Size``, a path, a layout name, the memory-format enum: each built here from checked
  plain arguments, never by calling what the file names);
* ``BUILD``, ``SETITEM(S)``, ``APPEND(S)`` and ``ADDITEMS`` apply only to objects made earlier in
  the same parse (``BUILD`` once per object, only the dataclass's own fields, into the instance's
  ``__dict__``): no class, module or shared object is reachable;
* bounded: the file's size, the memo, the nesting depth of the result, and the size of any
  object that is hashed (dict keys, set items: shared references are counted as often as they
  occur, so a memo-built tree of tuples is refused before Python hashes it);
* the result is checked against the shape of DCP's ``Metadata`` (every field's type), each
  container and dataclass occurring once.

Everything refused is a :class:`~fsdp_bridge.errors.CheckpointError` naming the file.

On top of the parser, what is handed to ``dcp.load``: :class:`SafeDCPReader` (``.metadata`` read
here, every file it names inside its directory) and :class:`SafeLoadPlanner` (non-tensor items with
``torch.load(weights_only=True)``). The module sits below the backends: ``checkpoint`` reads its own
directories with it, and the backends' FSDP1 state-dict loaders read a user's DCP directory with it
(:func:`safe_storage_reader`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickletools
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from fsdp_bridge.errors import CheckpointError

__all__ = [
    "LIMITS",
    "MetadataLimits",
    "SafeDCPReader",
    "SafeLoadPlanner",
    "load_dcp_metadata",
    "parse_dcp_metadata",
    "read_dcp_metadata_bytes",
    "safe_child",
    "safe_storage_reader",
]


@dataclasses.dataclass(frozen=True)
class MetadataLimits:
    """The bounds every ``.metadata`` is parsed under."""

    max_bytes: int = 1 << 30
    """Largest file read (1 GiB; DCP metadata of a model with 10^5 tensors over 10^3 ranks is
    a few hundred MB)."""
    max_memo: int = 1 << 26
    """Most memo entries."""
    max_depth: int = 16
    """Deepest nesting of containers in the result (DCP's own is 6)."""
    max_key_nodes: int = 1024
    """Most values in one hashed object (a dict key or set item), shared references counted
    each time they occur (a ``MetadataIndex`` key is about 10)."""
    max_sequence: int = 4096
    """Longest ``torch.Size``, path or planner tuple."""
    max_int_bytes: int = 16
    """Widest integer (``LONG1``)."""


LIMITS = MetadataLimits()

_FIX = "the file is damaged or was not written by torch.distributed.checkpoint; use another checkpoint"


class _Refused(Exception):
    """One reason a ``.metadata`` is refused (turned into a CheckpointError naming the file)."""


@dataclasses.dataclass(frozen=True)
class _Name:
    """What ``GLOBAL``/``STACK_GLOBAL`` push: a name, never the object it names."""

    module: str
    name: str


# Classes NEWOBJ may instantiate (fresh, empty, filled by one BUILD of their own fields).
_CLASSES: dict[tuple[str, str], type] = {
    (dcp_metadata.__name__, cls.__name__): cls
    for cls in (
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorProperties,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
    )
}
_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
try:  # the Hugging Face writer's storage record (torch >= 2.8)
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo

    _CLASSES[("torch.distributed.checkpoint._hf_utils", "_HFStorageInfo")] = _HFStorageInfo
except ImportError:  # pragma: no cover - older torch
    pass
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _CLASSES.values()}

_MEM_FORMAT = dcp_metadata._MEM_FORMAT_ENCODING
_MEMORY_FORMATS = {
    _MEM_FORMAT.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    _MEM_FORMAT.TORCH_CHANNELS_LAST: torch.channels_last,
    _MEM_FORMAT.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}

# Values a name may stand for directly (``torch.float32``): immutable torch singletons.
_TORCH_VALUES: dict[str, Any] = {
    name: value
    for name in dir(torch)
    if isinstance(value := getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
}
_LAYOUTS = {str(v): v for v in _TORCH_VALUES.values() if isinstance(v, torch.layout)}
# Paths are built as pure paths (only ``StorageMeta.checkpoint_id`` holds one, for information).
_PATHS: dict[str, type[PurePath]] = {
    "PosixPath": PurePosixPath,
    "PurePosixPath": PurePosixPath,
    "WindowsPath": PureWindowsPath,
    "PureWindowsPath": PureWindowsPath,
}
_REDUCERS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    (dcp_metadata.__name__, "_MEM_FORMAT_ENCODING"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    *(("pathlib", name) for name in _PATHS),
}

_ATOMS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.layout, torch.memory_format, _MEM_FORMAT)
_MARK = object()
_NOTHING = object()
_PUSH_ARGUMENT = frozenset(
    {"BININT", "BININT1", "BININT2", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}
    | {"SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}
)
_PUTS = frozenset(("PUT", "BINPUT", "LONG_BINPUT"))
_GETS = frozenset(("GET", "BINGET", "LONG_BINGET"))
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
_MAX_SAME_HASH = 8
"""Most keys of one dict (items of one set) with the same hash: equal hashes make every
insertion compare against all earlier ones (crafted colliding tuples would take quadratic time)."""


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


class _Interpreter:
    def __init__(self, limits: MetadataLimits) -> None:
        self.limits = limits
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.made: dict[int, Any] = {}  # id -> object made in this parse (kept alive: ids stay unique)
        self.built: set[int] = set()  # dataclass instances already given their BUILD
        self.hashes: dict[int, dict[int, int]] = {}  # id of a dict or set -> hash -> how many keys

    # ---- helpers --------------------------------------------------------------------

    def make(self, obj: Any) -> Any:
        self.made[id(obj)] = obj
        return obj

    def mine(self, obj: Any, types: type | tuple[type, ...], op: str) -> Any:
        if id(obj) not in self.made or not isinstance(obj, types):
            raise _Refused(f"{op} on a {type(obj).__name__} this file did not create (only its own objects are filled)")
        return obj

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise _Refused("an opcode needs a MARK and there is none")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise _Refused("the stack is empty where a value is needed")
        value = self.stack.pop()
        if value is _MARK:
            raise _Refused("a MARK where a value is needed")
        return value

    def hashable(self, value: Any) -> Any:
        """``value`` if it is small enough to hash: a plain value, a tuple, frozenset or a built
        MetadataIndex of such, at most ``max_key_nodes`` values counted with repetition."""
        budget = self.limits.max_key_nodes
        todo: list[tuple[Any, int]] = [(value, 0)]
        while todo:
            item, depth = todo.pop()
            budget -= 1
            if budget < 0 or depth > self.limits.max_depth:
                raise _Refused(
                    f"a dict key or set item is larger than {self.limits.max_key_nodes} values "
                    f"or deeper than {self.limits.max_depth} (counting repeated references)"
                )
            if isinstance(item, _ATOMS):
                continue
            if isinstance(item, (tuple, frozenset)):
                todo.extend((x, depth + 1) for x in item)
            elif isinstance(item, dcp_metadata.MetadataIndex) and id(item) in self.built:
                todo.extend((x, depth + 1) for x in item.__dict__.values())
            else:
                raise _Refused(f"a {type(item).__name__} cannot be a dict key or set item in DCP metadata")
        return value

    def key_for(self, container: Any, value: Any) -> Any:
        """``value`` checked by :meth:`hashable`, and not one hash too many in ``container``."""
        if type(value) is str:  # nearly every key; str hashes are salted per process: no crafted collisions
            return value
        seen = self.hashes.setdefault(id(container), {})
        h = hash(self.hashable(value))
        seen[h] = seen.get(h, 0) + 1
        if seen[h] > _MAX_SAME_HASH:
            raise _Refused(f"more than {_MAX_SAME_HASH} dict keys or set items with one hash (crafted collisions)")
        return value

    def ints(self, value: Any, what: str) -> list[int]:
        if not isinstance(value, (tuple, list)) or len(value) > self.limits.max_sequence:
            raise _Refused(f"{what} takes a sequence of at most {self.limits.max_sequence} integers")
        for v in value:
            if type(v) is not int or not 0 <= v < 2**63:
                raise _Refused(f"{what} takes integers in [0, 2**63)")
        return list(value)

    def strings(self, value: Any, what: str) -> list[str]:
        if not isinstance(value, tuple) or len(value) > self.limits.max_sequence:
            raise _Refused(f"{what} takes at most {self.limits.max_sequence} strings")
        if not all(isinstance(v, str) for v in value):
            raise _Refused(f"{what} takes strings")
        return list(value)

    # ---- opcodes that call or fill ----------------------------------------------------

    def reduce(self, func: Any, args: Any) -> Any:
        if not isinstance(func, _Name) or (func.module, func.name) not in _REDUCERS:
            shown = f"{func.module}.{func.name}" if isinstance(func, _Name) else type(func).__name__
            raise _Refused(f"refusing to call {shown} (only torch.Size, paths, layouts and DCP's own values are built)")
        if not isinstance(args, tuple):
            raise _Refused(f"the arguments of {func.name} are a {type(args).__name__}, not a tuple")
        key = (func.module, func.name)
        if key == ("torch", "Size"):
            if len(args) != 1:
                raise _Refused("torch.Size takes one sequence")
            return torch.Size(self.ints(args[0], "torch.Size"))
        if key == ("torch.serialization", "_get_layout"):
            if len(args) != 1 or args[0] not in _LAYOUTS:
                raise _Refused(f"a layout must be one of {sorted(_LAYOUTS)}")
            return _LAYOUTS[args[0]]
        if func.name == "_MEM_FORMAT_ENCODING":
            if len(args) != 1 or not _is_index(args[0]) or args[0] not in {m.value for m in _MEM_FORMAT}:
                raise _Refused(f"a memory format encoding must be one of {[m.value for m in _MEM_FORMAT]}")
            return _MEM_FORMAT(args[0])
        if func.module == "pathlib":
            return _PATHS[func.name](*self.strings(args, "a path"))
        if func.name == "OrderedDict":
            if args:
                raise _Refused("OrderedDict is only built empty (its items follow)")
            return self.make({})
        if func.name in ("set", "frozenset"):
            items = args[0] if len(args) == 1 else ()
            if len(args) > 1 or not isinstance(items, (list, tuple)):
                raise _Refused(f"{func.name} takes one list")
            box = object()
            made = [self.key_for(box, v) for v in items]
            return self.make(set(made)) if func.name == "set" else frozenset(made)
        # slice
        if len(args) > 3 or not all(v is None or isinstance(v, int) for v in args):
            raise _Refused("slice takes up to three integers or None")
        return slice(*args)

    def newobj(self, cls: Any, args: Any) -> Any:
        found = _CLASSES.get((cls.module, cls.name)) if isinstance(cls, _Name) else None
        if found is None:
            shown = f"{cls.module}.{cls.name}" if isinstance(cls, _Name) else type(cls).__name__
            raise _Refused(f"refusing to create {shown} (only DCP's metadata classes are created)")
        if args != ():
            raise _Refused(f"{cls.name} is created without arguments (its fields follow)")
        return self.make(object.__new__(found))

    def build(self, obj: Any, state: Any) -> None:
        self.mine(obj, tuple(_FIELDS), "BUILD")
        if id(obj) in self.built:
            raise _Refused(f"a second BUILD of one {type(obj).__name__}")
        self.built.add(id(obj))
        fields = _FIELDS[type(obj)]
        if isinstance(obj, dcp_metadata.TensorProperties) and isinstance(state, tuple):
            # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format code, pin_memory).
            if len(state) != 5:
                raise _Refused("TensorProperties holds five values")
            dtype, layout, requires_grad, code, pin_memory = state
            if code not in _MEMORY_FORMATS:
                raise _Refused("TensorProperties names an unknown memory format")
            state = {
                "dtype": dtype,
                "layout": layout,
                "requires_grad": requires_grad,
                "memory_format": _MEMORY_FORMATS[code],
                "pin_memory": pin_memory,
            }
        elif isinstance(state, tuple) and len(state) == 2 and not state[1]:
            state = state[0]  # (dict state, no slot state)
        if state is None:
            return
        if not isinstance(state, dict) or not all(isinstance(k, str) and k in fields for k in state):
            raise _Refused(f"the state of a {type(obj).__name__} may only set its fields ({', '.join(sorted(fields))})")
        obj.__dict__.update(state)

    # ---- the loop -----------------------------------------------------------------------

    def run(self, data: bytes) -> Any:
        limits = self.limits
        stack, memo, marks = self.stack, self.memo, self.marks
        # The opcodes of nearly every step are handled inline (a 12 MB file has a million).
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            name = opcode.name
            if name in _PUSH_ARGUMENT:
                stack.append(arg)
            elif name == "MEMOIZE" or name in _PUTS:
                if not stack or stack[-1] is _MARK:
                    raise _Refused("memoizing with nothing on the stack")
                if len(memo) >= limits.max_memo:
                    raise _Refused(f"more than {limits.max_memo} memo entries")
                key = len(memo) if name == "MEMOIZE" else arg
                if not isinstance(key, int):
                    raise _Refused(f"memo key {type(key).__name__} is not an integer")
                memo[key] = stack[-1]
            elif name in _GETS:
                value = memo.get(arg, _NOTHING) if isinstance(arg, int) else _NOTHING
                if value is _NOTHING:
                    raise _Refused(f"memo entry {arg} is used before it is set")
                stack.append(value)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name == "MARK":
                marks.append(len(stack))
                stack.append(_MARK)
            elif name in ("PROTO", "FRAME"):
                continue
            elif name == "STOP":
                if len(stack) != 1 or marks:
                    raise _Refused("the pickle does not end with exactly one value")
                return stack[0]
            else:
                value = self.value(name, arg)
                if value is not _NOTHING:
                    stack.append(value)
        raise _Refused("the pickle has no STOP")

    def value(self, name: str, arg: Any) -> Any:  # one branch per opcode
        if name == "LONG1":
            if not isinstance(arg, int) or arg.bit_length() > 8 * self.limits.max_int_bytes:
                raise _Refused(f"an integer wider than {self.limits.max_int_bytes} bytes")
            return arg
        if name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = [self.pop() for _ in range(n)][::-1]
            return tuple(items)
        if name == "TUPLE":
            return tuple(self.pop_mark()[1:])
        if name == "EMPTY_LIST":
            return self.make([])
        if name == "LIST":
            return self.make(self.pop_mark()[1:])
        if name == "EMPTY_DICT":
            return self.make({})
        if name == "EMPTY_SET":
            return self.make(set())
        if name == "DICT":
            items = self.pop_mark()[1:]
            target = self.make({})
            self.set_items(target, items)
            return target
        if name == "FROZENSET":
            box = object()
            return frozenset([self.key_for(box, v) for v in self.pop_mark()[1:]])
        if name in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD", "POP", "POP_MARK", "DUP"):
            return self.mutate(name)
        if name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
            else:
                attr, module = self.pop(), self.pop()
            if not isinstance(module, str) or not isinstance(attr, str):
                raise _Refused("a global's module and name must be strings")
            if module == "torch" and attr in _TORCH_VALUES:
                return _TORCH_VALUES[attr]  # torch.float32 and the like: values, not callables
            if (module, attr) in _CLASSES or (module, attr) in _REDUCERS:
                return _Name(module, attr)
            raise _Refused(
                f"refusing to load {module}.{attr} from DCP metadata (only DCP's own metadata classes are read)"
            )
        if name == "REDUCE":
            args = self.pop()
            return self.reduce(self.pop(), args)
        if name == "NEWOBJ":
            args = self.pop()
            return self.newobj(self.pop(), args)
        if name == "NEWOBJ_EX":
            kwargs, args = self.pop(), self.pop()
            if kwargs != {}:
                raise _Refused("objects are created without keyword arguments")
            return self.newobj(self.pop(), args)
        raise _Refused(f"opcode {name} is not used by DCP metadata and is refused")

    def set_items(self, target: dict[Any, Any], items: list[Any]) -> None:
        if len(items) % 2:
            raise _Refused("SETITEMS with an odd number of values")
        for i in range(0, len(items), 2):
            target[self.key_for(target, items[i])] = items[i + 1]

    def mutate(self, name: str) -> Any:
        """Opcodes that change the stack or an object in place (nothing new is pushed)."""
        stack = self.stack
        if name == "POP":
            if stack and stack[-1] is _MARK:
                self.marks.pop()
                stack.pop()
            else:
                self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            value = self.pop()
            stack.extend((value, value))
        elif name == "APPEND":
            value = self.pop()
            self.mine(stack[-1] if stack else None, list, "APPEND").append(value)
        elif name == "APPENDS":
            items = self.pop_mark()[1:]
            self.mine(stack[-1] if stack else None, list, "APPENDS").extend(items)
        elif name == "SETITEM":
            value, key = self.pop(), self.pop()
            self.set_items(self.mine(stack[-1] if stack else None, dict, "SETITEM"), [key, value])
        elif name == "SETITEMS":
            items = self.pop_mark()[1:]
            self.set_items(self.mine(stack[-1] if stack else None, dict, "SETITEMS"), items)
        elif name == "ADDITEMS":
            items = self.pop_mark()[1:]
            target = self.mine(stack[-1] if stack else None, set, "ADDITEMS")
            target.update([self.key_for(target, v) for v in items])
        else:  # BUILD
            state = self.pop()
            self.build(stack[-1] if stack else None, state)
        return _NOTHING


class _Shape:
    """Checks the parsed value is DCP ``Metadata`` of the expected shape, each container and
    dataclass instance occurring once (so nothing downstream walks a shared subtree twice)."""

    def __init__(self, limits: MetadataLimits) -> None:
        self.limits = limits
        self.seen: set[int] = set()

    def once(self, value: Any, what: str) -> None:
        if id(value) in self.seen:
            raise _Refused(f"{what} occurs more than once (a shared or cyclic reference)")
        self.seen.add(id(value))

    def instance(self, value: Any, cls: type, what: str, *, optional: bool = False) -> bool:
        if value is None and optional:
            return False
        if type(value) is not cls:
            raise _Refused(f"{what} is a {type(value).__name__}, expected {cls.__name__}")
        self.once(value, what)
        return True

    def index(self, value: Any, what: str, *, optional: bool = False) -> None:
        if not (_is_index(value) or (optional and value is None)):
            raise _Refused(f"{what} is a {type(value).__name__}, expected an integer >= 0")

    def string(self, value: Any, what: str, *, optional: bool = False) -> None:
        if not (isinstance(value, str) or (optional and value is None)):
            raise _Refused(f"{what} is a {type(value).__name__}, expected a string")

    def size(self, value: Any, what: str) -> None:
        if type(value) is not torch.Size:
            raise _Refused(f"{what} is a {type(value).__name__}, expected torch.Size")

    def mapping(self, value: Any, what: str) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise _Refused(f"{what} is a {type(value).__name__}, expected a dict")
        self.once(value, what)
        return value

    def plain(self, value: Any, what: str, depth: int = 0) -> None:
        """A value of an ``Any`` field (planner data): plain values and containers of them."""
        if depth > self.limits.max_depth:
            raise _Refused(f"{what} is nested deeper than {self.limits.max_depth}")
        if isinstance(value, (*_ATOMS, slice)):
            return
        if isinstance(value, (tuple, frozenset, list, dict, set)):
            if len(value) > self.limits.max_sequence and not isinstance(value, dict):
                raise _Refused(f"{what} holds more than {self.limits.max_sequence} values")
            if len(value) and not isinstance(value, torch.Size):
                # a shared tuple too: walking a DAG of them (and any later repr) would be exponential
                self.once(value, what)
        else:
            raise _Refused(f"{what} holds a {type(value).__name__}, expected plain values")
        # (dict items are walked as keys and values: an items() pair is a temporary whose id recurs)
        for item in (*value.keys(), *value.values()) if isinstance(value, dict) else value:
            self.plain(item, what, depth + 1)

    def metadata(self, value: Any) -> dcp_metadata.Metadata:
        self.instance(value, dcp_metadata.Metadata, "the file")
        fields = value.__dict__
        for key, item in self.mapping(fields.get("state_dict_metadata"), "state_dict_metadata").items():
            self.string(key, "a state_dict_metadata key")
            if type(item) is dcp_metadata.BytesStorageMetadata:
                self.instance(item, dcp_metadata.BytesStorageMetadata, f"the entry of {key!r:.80}")
                continue
            self.tensor(item, f"the entry of {key!r:.80}")
        planner = fields.get("planner_data")
        if planner is not None:
            self.plain(planner, "planner_data")
        storage = fields.get("storage_data")
        if storage is not None:
            for index, info in self.mapping(storage, "storage_data").items():
                self.instance(index, dcp_metadata.MetadataIndex, "a storage_data key")
                self.string(index.__dict__.get("fqn"), "a storage_data key's fqn")
                if index.__dict__.get("offset") is not None:
                    self.size(index.offset, "a storage_data key's offset")
                self.index(index.__dict__.get("index"), "a storage_data key's index", optional=True)
                self.storage_info(info)
        meta = fields.get("storage_meta")
        if self.instance(meta, dcp_metadata.StorageMeta, "storage_meta", optional=True):
            d = meta.__dict__
            cid = d.get("checkpoint_id")
            if not (cid is None or isinstance(cid, (str, PurePath))):
                raise _Refused(f"storage_meta.checkpoint_id is a {type(cid).__name__}, expected a string or path")
            self.string(d.get("save_id"), "storage_meta.save_id", optional=True)
            self.string(d.get("load_id"), "storage_meta.load_id", optional=True)
            modules = d.get("modules", [])
            if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
                raise _Refused("storage_meta.modules is not a list of strings")
            self.once(modules, "storage_meta.modules")
        self.string(fields.get("version"), "version", optional=True)
        return value

    def tensor(self, item: Any, what: str) -> None:
        self.instance(item, dcp_metadata.TensorStorageMetadata, what)
        d = item.__dict__
        self.instance(d.get("properties"), dcp_metadata.TensorProperties, f"{what}'s properties")
        props = d["properties"].__dict__
        if not isinstance(props.get("dtype"), torch.dtype):
            raise _Refused(f"{what}'s dtype is a {type(props.get('dtype')).__name__}, expected a torch dtype")
        for key, kind in (("layout", torch.layout), ("memory_format", torch.memory_format), ("requires_grad", bool)):
            if key in props and not isinstance(props[key], kind):
                raise _Refused(f"{what}'s {key} is a {type(props[key]).__name__}")
        if "pin_memory" in props and not isinstance(props["pin_memory"], bool):
            raise _Refused(f"{what}'s pin_memory is a {type(props['pin_memory']).__name__}")
        self.size(d.get("size"), f"{what}'s size")
        chunks = d.get("chunks")
        if not isinstance(chunks, list):
            raise _Refused(f"{what}'s chunks is a {type(chunks).__name__}, expected a list")
        self.once(chunks, f"{what}'s chunks")
        for chunk in chunks:
            self.instance(chunk, dcp_metadata.ChunkStorageMetadata, f"a chunk of {what}")
            self.size(chunk.__dict__.get("offsets"), f"a chunk of {what}: offsets")
            self.size(chunk.__dict__.get("sizes"), f"a chunk of {what}: sizes")

    def storage_info(self, info: Any) -> None:
        if type(info) not in (c for c in _CLASSES.values() if c.__name__ in ("_StorageInfo", "_HFStorageInfo")):
            raise _Refused(f"a storage_data value is a {type(info).__name__}, expected a storage record")
        self.once(info, "a storage_data value")
        d = info.__dict__
        self.string(d.get("relative_path"), "a storage record's relative_path")
        if type(info) is _StorageInfo:
            self.index(d.get("offset"), "a storage record's offset")
            self.index(d.get("length"), "a storage record's length")
            descriptors = d.get("transform_descriptors")
            if descriptors is not None and not (
                isinstance(descriptors, (list, tuple)) and all(isinstance(x, str) for x in descriptors)
            ):
                raise _Refused("a storage record's transform_descriptors is not a list of strings")
        else:
            self.size(d.get("shape"), "a storage record's shape")
            if not isinstance(d.get("dtype"), torch.dtype):
                raise _Refused("a storage record's dtype is not a torch dtype")


def parse_dcp_metadata(data: bytes, path: Path, limits: MetadataLimits = LIMITS) -> dcp_metadata.Metadata:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, built without unpickling.

    Args:
        data: the file's content.
        path: the file, for error messages.
        limits: the bounds (the defaults are :data:`LIMITS`).

    Returns:
        A fresh ``Metadata`` whose every object was made by this call.

    Raises:
        CheckpointError: anything outside DCP's metadata, or over a bound; names the file.
    """
    if len(data) > limits.max_bytes:
        raise CheckpointError(
            path, f"is {len(data)} bytes, over the {limits.max_bytes}-byte limit for DCP metadata; {_FIX}"
        )
    try:
        value = _Interpreter(limits).run(data)
        return _Shape(limits).metadata(value)
    except _Refused as err:
        raise CheckpointError(path, f"is not DCP metadata this version reads: {err}; {_FIX}") from None
    except Exception as err:  # pickletools' own errors (a truncated or garbled opcode stream) and the like
        # The message never shows a parsed value (only types), so nothing from the file is formatted.
        text = " ".join(str(err).split())[:200]
        raise CheckpointError(
            path,
            f"cannot be read ({type(err).__name__}: {text}); the DCP metadata is truncated, damaged or not DCP; {_FIX}",
        ) from None


def read_dcp_metadata_bytes(path: Path, limits: MetadataLimits = LIMITS) -> bytes:
    """The bytes of a ``.metadata`` file, refusing one over ``limits.max_bytes`` before reading it."""
    try:
        with open(path, "rb") as f:
            size = _file_size(f)
            if size > limits.max_bytes:
                raise CheckpointError(
                    path, f"is {size} bytes, over the {limits.max_bytes}-byte limit for DCP metadata; {_FIX}"
                )
            data = f.read(limits.max_bytes + 1)
    except FileNotFoundError as err:
        raise CheckpointError(path, "missing: the DCP directory is incomplete") from err
    except OSError as err:
        raise CheckpointError(path, f"cannot be read ({err})") from err
    if len(data) > limits.max_bytes:
        raise CheckpointError(path, f"is over the {limits.max_bytes}-byte limit for DCP metadata; {_FIX}")
    return data


def _file_size(f: Any) -> int:
    return os.fstat(f.fileno()).st_size


# --------------------------------------------------------------------------------------
# DCP's reader and planner on top of the parser: what fsdp_bridge hands to dcp.load
# --------------------------------------------------------------------------------------


def safe_child(root: Path, relative: str) -> Path:
    """``root / relative`` refusing anything that would leave ``root`` (absolute paths, ``..``, links)."""
    try:
        candidate = (root / relative).resolve()
    except (OSError, ValueError, RuntimeError) as err:  # a NUL byte, a symlink loop
        raise CheckpointError(root, f"names a file that cannot be a path ({relative!r:.80}: {err})") from None
    if os.path.isabs(relative) or not candidate.is_relative_to(root.resolve()):
        raise CheckpointError(root, f"names a file outside its directory ({relative!r:.80}); refusing it")
    return candidate


class SafeDCPReader(FileSystemReader):
    """A :class:`FileSystemReader` whose ``.metadata`` is read by :func:`load_dcp_metadata` (never unpickled)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / ".metadata"
        return load_dcp_metadata(path)


def load_dcp_metadata(path: Path) -> dcp_metadata.Metadata:
    """DCP ``Metadata`` of a ``.metadata`` file, read by :func:`parse_dcp_metadata` (never
    unpickled; bounded in size, depth, memo and hashing), with every file it names checked to be
    inside its directory.

    Raises:
        CheckpointError: the file is missing, over a bound, not DCP metadata, or names a file
            outside its directory.
    """
    metadata = parse_dcp_metadata(read_dcp_metadata_bytes(path), path)
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(path, f"holds a {type(metadata).__name__}, not DCP Metadata")
    # Where DCP will read each item: never outside the checkpoint's directory (each file once:
    # every item of a file names it).
    relatives = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    for relative in relatives:
        if not isinstance(relative, str):
            raise CheckpointError(path, f"a storage entry names {relative!r} instead of a file name")
        safe_child(path.parent, relative)
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            # The same helper DefaultLoadPlanner.load_bytes uses.
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_storage_reader(storage_reader: Any) -> Any:
    """``storage_reader`` with its ``.metadata`` read by :func:`load_dcp_metadata`.

    torch's own ``FileSystemReader`` unpickles the file: it is replaced by a :class:`SafeDCPReader`
    of the same directory. Any other reader (a subclass, another storage) is the caller's own code
    and is returned as it is."""
    if type(storage_reader) is FileSystemReader:
        return SafeDCPReader(storage_reader.path)
    return storage_reader
