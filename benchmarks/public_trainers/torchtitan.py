"""Drives the first FSDP1 trainer of pytorch/torchtitan (``train.py`` at ab5d918, the parent of its move to
per-parameter FSDP) on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the checkout and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/torchtitan.py

The trainer builds a Llama model on the meta device, wraps each transformer block and then the root with
FSDP1's ``enable_wrap``/``wrap`` (``param_init_fn`` materialising the weights on each rank,
``MixedPrecision`` in bf16 with fp32 reduction, ``BACKWARD_PRE``, ``device_mesh`` from its own mesh), applies
selective activation checkpointing, clips with ``model.clip_grad_norm_`` behind ``isinstance(model, FSDP)``,
and steps a ``ShardedGradScaler``. This driver runs its ``train.py`` as ``__main__`` with its own debug
config (``train_configs/debug_model.toml``: the 2-layer ``debugmodel``), shortened to 6 steps of 2 sequences
of 64 tokens, without the profiler (a copy of that config, written to the run's ``outputs`` folder). What
the trainer reads from elsewhere is made here:

* the SentencePiece tokenizer model (a file the checkout does not hold; ``sentencepiece`` is a stub when not
  installed) is a word-level vocabulary of the
  sample text shipped in ``fsdp_bridge/data``, with the trainer's ``encode(text, bos, eos)`` and ``n_words``;
* the alpaca rows from the hub (``datasets.load_dataset``, not installed here) are passages of that text;
* it names the accelerator outright (``.cuda()`` on tensors and modules, ``init_device_mesh("cuda", ...)``,
  ``torch.randn_like(..., device="cuda")`` in its meta initialisation, CUDA memory statistics): on this
  machine those mean the CPU, for both runs alike (``verify`` adds its own shims for process groups and
  ``torch.cuda.set_device``);
* after wrapping, the trainer draws its weights a second time (``model.reset_parameters()``, truncated normals
  for the linear layers) into what each rank holds: on FSDP1 the pieces of the rank's flat-parameter shard,
  seen as 1D views, on FSDP2 each parameter's DTensor shard, drawn from DTensor's own generator. No FSDP2
  code can draw FSDP1's values (they depend on FSDP1's flat layout), so that second draw is skipped in both
  runs: the weights are those of the trainer's meta-device initialisation (``param_init_fn``, a normal draw
  per parameter, unit by unit in FSDP1's order), which the bridge reproduces. With
  ``TORCHTITAN_KEEP_REINIT=1`` the draw is kept, and the two runs start from different random weights;
* a private activation-checkpointing helper of the torch of its time, imported and not used by this run, is
  a placeholder where today's torch no longer has it.
"""

from __future__ import annotations

import importlib.machinery
import os
import runpy
import sys
import types
from collections import namedtuple
from typing import Any

import tomllib
import torch
from _common import sample_words, stub_missing

WORDS = sample_words()


class _WordTokenizer:
    """The trainer's tokenizer interface (``n_words``, ``encode(s, bos, eos)``, ``decode``) over the sample
    text's words; 0 and 1 are BOS and EOS."""

    def __init__(self) -> None:
        self.vocab = {w: i + 2 for i, w in enumerate(sorted(set(WORDS)))}
        self.words = {i: w for w, i in self.vocab.items()}
        self.n_words = len(self.vocab) + 2
        self.bos_id, self.eos_id = 0, 1

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        ids = [self.vocab[w] for w in s.split() if w in self.vocab]
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words.get(i, "") for i in ids)


def _rows() -> list[dict[str, str]]:
    return [{"text": " ".join(WORDS[i : i + 48])} for i in range(0, 48 * 64, 48)]


def _datasets_stub() -> None:
    """``datasets`` (hub datasets) is not installed: the names the trainer imports, reading the rows above."""
    datasets = types.ModuleType("datasets")
    datasets.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    datasets.load_dataset = lambda *a, **k: _rows()  # type: ignore[attr-defined]
    datasets.load_from_disk = lambda *a, **k: _rows()  # type: ignore[attr-defined]
    distributed = types.ModuleType("datasets.distributed")
    distributed.__spec__ = importlib.machinery.ModuleSpec("datasets.distributed", None)
    distributed.split_dataset_by_node = lambda ds, rank, world_size: ds[rank::world_size]  # type: ignore[attr-defined]
    datasets.distributed = distributed  # type: ignore[attr-defined]
    sys.modules.setdefault("datasets", datasets)
    sys.modules.setdefault("datasets.distributed", distributed)


_Stats = namedtuple(
    "_Stats",
    "max_active_gib max_active_pct max_reserved_gib max_reserved_pct num_alloc_retries num_ooms",
)


class _MemoryMonitor:
    device_name = "cpu"

    def get_peak_stats(self) -> _Stats:
        return _Stats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def _on_cpu(device: Any) -> Any:
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


def _accelerator_is_the_cpu() -> None:
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    randn_like = torch.randn_like

    def randn_like_on_cpu(t: torch.Tensor, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return randn_like(t, *args, device=_on_cpu(device), **kwargs)

    torch.randn_like = randn_like_on_cpu  # type: ignore[assignment]


def _torch_of_its_time() -> None:
    """It imports a private activation-checkpointing helper that later torch releases removed, for its
    per-operator policy; this run checkpoints every second block (the config's ``selective_ac_option = '2'``)
    and never calls it."""
    import torch.utils.checkpoint as checkpoint

    def removed(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("per-operator selective checkpointing: not part of this run")

    if not hasattr(checkpoint, "_pt2_selective_checkpoint_context_fn_gen"):
        checkpoint._pt2_selective_checkpoint_context_fn_gen = removed  # type: ignore[attr-defined]


def main() -> None:
    # Its JobConfig.parse_args takes sys.argv[1:] as a default argument, read when the module is imported:
    # the command line is set before any of its modules is.
    dump = os.path.abspath("outputs")
    os.makedirs(dump, exist_ok=True)
    with open("train_configs/debug_model.toml", "rb") as f:
        config = tomllib.load(f)
    config["profiling"]["run_profiler"] = False  # a store_true flag: only the file can turn it off
    config["training"].update(steps=6, batch_size=2, seq_len=64)
    config["job"]["dump_folder"] = dump
    path = os.path.join(dump, "debug_model_cpu.toml")
    with open(path, "w") as f:
        f.write(_toml(config))
    sys.argv = ["train.py", "--job.config_file", path]

    _datasets_stub()
    _torch_of_its_time()
    stub_missing({"sentencepiece": {"SentencePieceProcessor": None}})  # its tokenizer: replaced below
    _accelerator_is_the_cpu()
    import torchtrain.datasets
    import torchtrain.metrics
    import torchtrain.parallelisms

    torchtrain.datasets.create_tokenizer = lambda kind, path: _WordTokenizer()
    if os.environ.get("TORCHTITAN_KEEP_REINIT") != "1":
        import torchtrain.models.llama.model as llama

        # After wrapping it calls model.reset_parameters(), which draws fresh random weights into what each
        # rank holds: on FSDP1 the pieces of its flat-parameter shard (1D views), on FSDP2 each DTensor shard
        # from DTensor's own generator. The two draws cannot match; see the module docstring.
        llama.Transformer.reset_parameters = lambda self: None
    torchtrain.metrics.build_gpu_memory_monitor = _MemoryMonitor
    init_device_mesh = torchtrain.parallelisms.init_device_mesh
    torchtrain.parallelisms.init_device_mesh = lambda device_type, *a, **k: init_device_mesh(
        _on_cpu(device_type), *a, **k
    )
    runpy.run_path("train.py", run_name="__main__")


def _toml(config: dict[str, dict[str, Any]]) -> str:
    """The trainer's flat config (sections of strings, numbers and booleans) written back as TOML."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return repr(v) if isinstance(v, (int, float)) else '"' + str(v).replace('"', '\\"') + '"'

    return "".join(
        f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in items.items()) + "\n"
        for section, items in config.items()
    )


if __name__ == "__main__":
    main()
