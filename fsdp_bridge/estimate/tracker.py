"""Count the bytes of tensor storages alive on one device type, and their peak.

:class:`LiveBytes` is a dispatch mode: every storage an operator creates on the
watched device type is counted until it is freed.  On the ``meta`` device it
measures what a forward/backward *would* allocate without allocating anything (the
estimator's activation figure); on ``cpu`` it gives the peak tensor memory of a real
CPU run, which ``torch.cuda.max_memory_allocated`` gives on GPUs.

Storages that existed before the mode was entered are not counted (pass
``ignore=`` to make that explicit for tensors created inside it).

``LiveBytes(..., sites=True)`` also records where each storage was allocated (the operator
and the nearest Python frame outside torch's dispatch machinery) and, at every new peak, the
bytes alive per site: ``live.peak_sites`` says what made up the peak.

Both FSDP versions free a gathered parameter with ``storage.resize_(0)`` and allocate it
again with ``storage.resize_(n)``, while autograd may still hold tensors viewing it; no
operator reports that, so while the mode is active ``UntypedStorage.resize_`` is wrapped
and a resized storage counts its new size (a storage that grows inside the mode is
counted from then on, as if created there).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "storage_bytes"]

# Frames that say nothing about who allocated: this module, the dispatch-mode plumbing and
# torch's decorator wrappers.
_PLUMBING = (
    os.path.normcase(__file__),
    os.path.join("torch", "utils", "_python_dispatch.py"),
    os.path.join("torch", "_compile.py"),
    os.path.join("torch", "_dynamo", "eval_frame.py"),
    os.path.join("torch", "utils", "_contextlib.py"),
)


def _site(op: str) -> str:
    """``op`` and the innermost frame outside :data:`_PLUMBING`, as ``op file:line (function)``."""
    frame = sys._getframe(1)
    while frame is not None and os.path.normcase(frame.f_code.co_filename).endswith(_PLUMBING):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return op
    path = frame.f_code.co_filename
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{op} {path}:{frame.f_lineno} ({frame.f_code.co_name})"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s data on this rank: a DTensor's local shard, else ``t``."""
    # A DTensor is a wrapper without storage of its own: its private _local_tensor is the
    # shard itself (to_local() returns a new view of it under grad mode).
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and DTensors resolved).

    Args:
        tensors: any tensors; views of one storage count once, a DTensor by its local shard.

    Returns:
        The total bytes.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        st = local_tensor(t).untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes("cpu") as live: ...``; then ``live.peak`` and ``live.current`` (bytes).

    ``sites=True``: also ``live.peak_sites``, the bytes alive at the peak per allocation site,
    largest first (slower: a frame walk per new storage and a tally per new peak)."""

    def __init__(self, device_type: str, *, ignore: Iterable[torch.Tensor] = (), sites: bool = False) -> None:
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self.sites = sites
        self.peak_sites: dict[str, int] = {}
        self._live: dict[int, int] = {}
        self._site: dict[int, str] = {}
        self._ignored = {local_tensor(t).untyped_storage()._cdata for t in ignore}
        self._restore: dict[str, Any] = {}  # UntypedStorage's own attributes before this mode wrapped resize_

    def reset_peak(self) -> None:
        """Restart peak tracking from the bytes alive now.

        Returns:
            None.
        """
        self.peak = self.current
        if self.sites:
            tally: Counter[str] = Counter()
            for key, nbytes in self._live.items():
                tally[self._site.get(key, "?")] += nbytes
            self.peak_sites = {site: n for site, n in tally.most_common() if n}

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
        self._site.pop(key, None)

    def _count(self, st: torch.UntypedStorage, op: str) -> None:
        """Count ``st`` at its size now (new, grown or shrunk); ``op`` made or resized it."""
        key = st._cdata
        if key in self._ignored:
            return  # deliberately not counted
        n = st.nbytes()
        old = self._live.get(key)
        if old is None:
            if n == 0:
                return  # nothing allocated (yet): counted when it grows
            weakref.finalize(st, self._freed, key)
            if self.sites:
                self._site[key] = _site(op)
        elif old == n:
            return  # a view of a storage already counted
        self._live[key] = n
        self.current += n - (old or 0)
        if self.current > self.peak:
            self.reset_peak()

    def _track(self, t: object, op: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = local_tensor(t)
        if t.device.type == self.device_type:
            self._count(t.untyped_storage(), op)

    def _unwrap(self) -> None:
        if "resize_" in self._restore:
            torch.UntypedStorage.resize_ = self._restore["resize_"]  # type: ignore[method-assign]
        else:  # inherited from torch._C.StorageBase: just remove the wrapper
            del torch.UntypedStorage.resize_
        self._restore = {}

    def __enter__(self) -> LiveBytes:
        resize = torch.UntypedStorage.resize_
        self._restore = {k: v for k, v in vars(torch.UntypedStorage).items() if k == "resize_"}

        def counted_resize(st: torch.UntypedStorage, size: int) -> Any:
            out = resize(st, size)
            if st.device.type == self.device_type:
                self._count(st, "storage.resize_")
            return out

        torch.UntypedStorage.resize_ = counted_resize  # type: ignore[method-assign,assignment]
        try:
            super().__enter__()
        except BaseException:
            self._unwrap()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._unwrap()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t, str(func))
        return out
