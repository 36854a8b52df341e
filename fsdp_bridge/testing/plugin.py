"""pytest plugin (registered through the ``pytest11`` entry point as ``fsdp_bridge``).

Installed with fsdp-bridge; nothing to import or configure.  It provides:

- ``@pytest.mark.distributed(world_size=2, backend="gloo", timeout=300)``: the test
  function runs on ``world_size`` spawned ranks with the default process group
  initialised (gloo on CPU; ``backend="nccl"`` for one GPU per rank, skipped when there
  are too few GPUs).  Its fixture arguments are passed to every rank (they must pickle).
  A failure on any rank fails the test with every failing rank's traceback.
- ``run_on_ranks(fn, world_size=2, *args, **kwargs)``: a fixture that runs a
  module-level ``fn`` on ranks from inside an ordinary test and returns each rank's
  result (several checks per spawn keep distributed tests fast).
- ``fsdp_backend`` / ``fsdp_strategy``: arguments parametrised over the backends and
  strategies chosen with ``--fsdp-backends`` (default fsdp1,fsdp2) and
  ``--fsdp-strategies`` (default full_shard,shard_grad_op,no_shard).
- ``@pytest.mark.cuda``: skipped without a CUDA GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fsdp_bridge.strategy import Backend

_DEFAULT_BACKENDS = ",".join(b.value for b in Backend)
_DEFAULT_STRATEGIES = "full_shard,shard_grad_op,no_shard"
_ALL_STRATEGIES = "full_shard,shard_grad_op,no_shard,hybrid_shard,hybrid_shard_zero2"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp_bridge", "fsdp_bridge distributed tests")
    group.addoption(
        "--fsdp-backends",
        default=_DEFAULT_BACKENDS,
        help="backends the fsdp_backend argument runs over (default: %(default)s)",
    )
    group.addoption(
        "--fsdp-strategies",
        default=_DEFAULT_STRATEGIES,
        help="strategies the fsdp_strategy argument runs over; 'all' for all five "
        "(default: %(default)s; hybrid ones need 4 ranks)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers",
        "distributed(world_size=2, backend='gloo', timeout=300): run the test function on world_size spawned "
        "ranks (gloo on CPU, 'nccl' for one GPU per rank); a failing rank's traceback fails the test",
    )


def _choices(config: pytest.Config, option: str, kind: str) -> list[str]:
    from fsdp_bridge.strategy import Backend, ShardingStrategy, parse_enum

    enum_cls: Any = Backend if kind == "backend" else ShardingStrategy
    text = str(config.getoption(option))
    if kind == "strategy" and text.strip() == "all":
        text = _ALL_STRATEGIES
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            out.append(parse_enum(enum_cls, item).value)
        except ValueError as err:
            raise pytest.UsageError(f"--{option.replace('_', '-')}: {err}") from None
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fsdp_backend" in metafunc.fixturenames:
        metafunc.parametrize("fsdp_backend", _choices(metafunc.config, "fsdp_backends", "backend"))
    if "fsdp_strategy" in metafunc.fixturenames:
        metafunc.parametrize("fsdp_strategy", _choices(metafunc.config, "fsdp_strategies", "strategy"))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus: int | None = None
    for item in items:
        wants_cuda = "cuda" in item.keywords
        marker = item.get_closest_marker("distributed")
        need = 0
        if marker is not None:
            try:
                world, backend, _ = _marker_args(marker)
            except ValueError:  # reported when the test runs, as that test's failure
                world, backend = 0, "gloo"
            need = world if backend == "nccl" else 0
        if not (wants_cuda or need):
            continue
        gpus = _gpus() if gpus is None else gpus
        if wants_cuda and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is available"))
        elif need > gpus:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPUs for NCCL; {gpus} available"))


def _marker_args(marker: pytest.Mark) -> tuple[int, str, float]:
    """(world_size, backend, timeout) of a ``distributed`` marker, validated."""

    def bad(what: str) -> ValueError:
        return ValueError(
            f"@pytest.mark.distributed: {what}; use "
            "@pytest.mark.distributed(world_size=2, backend='gloo' or 'nccl', timeout=300)"
        )

    allowed = {"world_size", "backend", "timeout"}
    if len(marker.args) > 1 or set(marker.kwargs) - allowed:
        raise bad(f"got args {marker.args} and keys {sorted(marker.kwargs)}")
    world = marker.args[0] if marker.args else marker.kwargs.get("world_size", 2)
    backend = marker.kwargs.get("backend", "gloo")
    timeout = marker.kwargs.get("timeout", 300.0)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise bad(f"world_size={world!r} is not an integer >= 1")
    if backend not in ("gloo", "nccl"):
        raise bad(f"backend={backend!r} is not 'gloo' or 'nccl'")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise bad(f"timeout={timeout!r} is not a number of seconds > 0")
    return world, backend, float(timeout)


def _run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> list[Any]:
    """run_distributed, turning a rank's failure into a test failure that shows every traceback."""
    from fsdp_bridge.testing._spawn import RankFailure, run_distributed

    try:
        return run_distributed(fn, world_size, args=args, kwargs=kwargs, backend=backend, timeout_s=timeout_s)
    except RankFailure as err:
        failure = err
    # Outside the except block, so pytest shows the ranks' tracebacks once (not chained).
    pytest.fail(
        f"{fn.__module__}.{fn.__qualname__} failed on ranks {sorted(failure.failures)}:\n{failure}", pytrace=False
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("distributed")
    if marker is None:
        return None
    try:
        world, backend, timeout = _marker_args(marker)
    except ValueError as err:
        problem = str(err)
    else:
        problem = ""
    if problem:
        pytest.fail(problem, pytrace=False)
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    _run(pyfuncitem.obj, world, kwargs=kwargs, backend=backend, timeout_s=timeout)
    return True


class RunOnRanks:
    """``run_on_ranks(fn, world_size=2, *args, backend="gloo", timeout_s=300, **kwargs)`` -> results by rank."""

    def __call__(
        self,
        fn: Callable[..., Any],
        world_size: int = 2,
        *args: Any,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        **kwargs: Any,
    ) -> list[Any]:
        if backend == "nccl" and _gpus() < world_size:
            pytest.skip(f"needs {world_size} CUDA GPUs for NCCL; {_gpus()} available")
        return _run(fn, world_size, args=args, kwargs=kwargs, backend=backend, timeout_s=timeout_s)


@pytest.fixture
def run_on_ranks() -> RunOnRanks:
    """Run a module-level function on N spawned ranks; a failing rank fails the test with its traceback."""
    return RunOnRanks()
