"""Training state (step, scheduler, data position, ...) and per-rank RNG states, as JSON.

JSON rather than pickle: loading a checkpoint never runs code from the file.  The
user's ``state`` must therefore be JSON-serialisable (scheduler ``state_dict()``\\ s are).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import torch

from fsdp_bridge.checkpoint._formats import RNG_DIR, STATE_FILE, CheckpointError

__all__ = [
    "capture_rng",
    "check_state",
    "parse_rng",
    "parse_state",
    "read_rng",
    "read_state",
    "restore_rng",
    "rng_name",
    "rng_text",
    "state_text",
    "write_rng",
    "write_state",
]


def _problems(value: Any, where: str) -> list[str]:
    if value is None or isinstance(value, (bool, int, str)):
        return []
    if isinstance(value, float):
        return []
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _problems(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                out.append(f"{where}: key {k!r} of type {type(k).__name__} (keys must be str or int)")
            out.extend(_problems(v, f"{where}[{k!r}]"))
        return out
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return [f"{where}: a tensor; store value.item() instead"]
    return [f"{where}: {type(value).__name__} is not JSON-serialisable"]


def check_state(state: Any) -> None:
    """Refuse (before any collective) a ``state`` that cannot be written as JSON."""
    if state is None:
        return
    if not isinstance(state, dict):
        raise TypeError(
            f"state must be a dict such as {{'step': 100, 'scheduler': sched.state_dict()}} "
            f"(got {type(state).__name__})"
        )
    problems = _problems(state, "state")
    if problems:
        raise TypeError(
            "state must hold only JSON values (dict, list, str, int, float, bool, None): " + "; ".join(problems)
        )


def _encode(value: Any) -> Any:
    # JSON has no tuples or int dict keys: tag them so that they come back identical.
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if any(isinstance(k, int) for k in value):
            return {"__intkeys__": [[k, _encode(v)] for k, v in value.items()]}
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        if set(value) == {"__intkeys__"}:
            return {k: _decode(v) for k, v in value["__intkeys__"]}
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def state_text(state: dict[str, Any] | None) -> str:
    """What ``train_state.json`` holds for ``state``."""
    return json.dumps(_encode(state or {}), indent=2) + "\n"


def write_state(directory: Path, state: dict[str, Any] | None) -> None:
    (directory / STATE_FILE).write_text(state_text(state))


def read_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE_FILE
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as err:
        raise CheckpointError(path, f"cannot be read ({err}); the training state is corrupt") from err
    return parse_state(text, path)


def parse_state(text: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The training state in ``text`` (read from ``path``, named in errors), checked."""
    try:
        state = _decode(json.loads(text))
    except (ValueError, TypeError, RecursionError) as err:
        raise CheckpointError(path, f"cannot be read ({err}); the training state is corrupt") from err
    if not isinstance(state, dict):
        raise CheckpointError(
            path,
            f"holds a JSON {type(state).__name__}, expected an object "
            "(the state dict passed to save_checkpoint); the training state is corrupt",
        )
    return state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """This rank's Python, NumPy, torch CPU and CUDA generator states."""
    out: dict[str, Any] = {"python": _encode(random.getstate()), "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
        out["numpy"] = [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # numpy is optional
        pass
    return out


def restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(_decode(rng["python"]))
    torch.set_rng_state(_unb64(rng["torch"]))
    if "cuda" in rng and torch.cuda.is_available():
        states = [_unb64(s) for s in rng["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    if "numpy" in rng:
        try:
            import numpy as np

            name, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        except ImportError:
            pass


def rng_file(directory: Path, rank: int) -> Path:
    return directory / rng_name(rank)


def rng_name(rank: int) -> str:
    """Where a rank's RNG states are, relative to the checkpoint directory."""
    return f"{RNG_DIR}/rank_{rank:05d}.json"


def rng_text() -> str:
    """What this rank's RNG file holds."""
    return json.dumps(capture_rng()) + "\n"


def write_rng(directory: Path, rank: int) -> None:
    path = rng_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rng_text())


def read_rng(directory: Path, rank: int) -> dict[str, Any] | None:
    path = rng_file(directory, rank)
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as err:
        raise CheckpointError(path, f"cannot be read ({err}); the RNG state is corrupt") from err
    return parse_rng(text, path)


def parse_rng(text: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The RNG states in ``text`` (read from ``path``, named in errors), checked."""
    try:
        rng = json.loads(text)
    except ValueError as err:
        raise CheckpointError(path, f"cannot be read ({err}); the RNG state is corrupt") from err
    if not _rng_valid(rng):
        raise CheckpointError(
            path,
            "is not an RNG state written by fsdp_bridge (expected python, torch and "
            "optionally cuda and numpy states); load with restore_rng=False to skip it",
        )
    return dict(rng)


def _rng_valid(rng: Any) -> bool:
    """Whether :func:`restore_rng` can apply ``rng`` (checked before anything is loaded)."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), str):
        return False
    try:
        python = _decode(rng.get("python"))
        state = random.Random()
        state.setstate(python)  # a scratch generator: validates without touching the global one
        torch.Generator().set_state(_unb64(rng["torch"]))
        cuda = rng.get("cuda", [])
        if not isinstance(cuda, list) or not all(isinstance(s, str) for s in cuda):
            return False
        for s in cuda:
            _unb64(s)
        if "numpy" in rng:
            name, keys, pos, _has_gauss, _gauss = rng["numpy"]
            if not (
                isinstance(name, str)
                and isinstance(keys, list)
                and len(keys) == 624
                and all(isinstance(k, int) for k in keys)
                and isinstance(pos, int)
            ):
                return False
    except (TypeError, ValueError, KeyError, RuntimeError, binascii.Error):
        return False
    return True
