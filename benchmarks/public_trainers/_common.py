"""What the drivers in this folder share: the package's sample text, stubs for unused imports, and FSDP1's full
state dict without its CPU offload.

The drivers run with this folder on ``sys.path`` (``fsdp-bridge migrate verify`` puts the driver's
directory there), so they import this module by its name.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import time
import types
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch


def sample_words() -> list[str]:
    """The words of the sample text shipped in ``fsdp_bridge/data``."""
    return files("fsdp_bridge").joinpath("data/sample_corpus.txt").read_text().split()


class CpuEvent:
    """``torch.cuda.Event(enable_timing=True)`` without a GPU: ``record``, ``synchronize``, ``elapsed_time``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.at = 0.0

    def record(self, *args: object) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: CpuEvent) -> float:
        return (end.at - self.at) * 1000.0


def sample_sentences() -> list[str]:
    """The sample text cut into sentences of twelve words."""
    words = sample_words()
    return [" ".join(words[i : i + 12]) for i in range(0, len(words) - 12, 12)]


def save_sample_tokenizer(directory: str, **special: str) -> Any:
    """A byte-level BPE tokenizer (400 ids) trained on the sample text, with ``<|endoftext|>`` as its end of text
    and as each of ``special`` (``bos_token=...``, ``pad_token=...``), saved where ``from_pretrained`` reads it;
    returned. The same files on every rank and in every run."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(sample_sentences(), vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", **special)
    tokenizer.save_pretrained(directory)
    return tokenizer


def save_tiny_gpt2(directory: str) -> None:
    """A 2-layer GPT-2 and a byte-level BPE tokenizer trained on the sample text, saved where
    ``from_pretrained`` reads them: the same files on every rank and in every run (seeded)."""
    import transformers

    tokenizer = save_sample_tokenizer(directory, bos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)


def load_trainer(relative: str, name: str) -> Any:
    """The tree's script at ``relative`` (in the copy ``verify`` put first on ``sys.path``), loaded by its path as
    module ``name``, with its folder first on ``sys.path`` as when the script is run there (``--target torch``
    writes its helper module beside it)."""
    path = next(Path(entry) / relative for entry in sys.path if (Path(entry) / relative).is_file())
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub_missing(stubs: dict[str, dict[str, Any]]) -> None:
    """A module with ``attrs`` for each name in ``stubs`` that is not installed (imported by a trainer for
    what the run does not use). Each has a spec: libraries that probe for a module (transformers) need one."""
    for name, attrs in stubs.items():
        try:
            __import__(name)
        except ImportError:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__dict__.update(attrs)
            sys.modules[name] = module


class _MNIST(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``datasets.MNIST(root, train=..., download=..., transform=...)``: seeded noise images, seeded labels."""

    sizes = (256, 64)  # (training, test) images, set by mnist_stub

    def __init__(self, root: str, train: bool = True, download: bool = False, transform: Any = None) -> None:
        generator = torch.Generator().manual_seed(0 if train else 1)
        count = self.sizes[0] if train else self.sizes[1]
        self.images = torch.rand(count, 1, 28, 28, generator=generator)
        self.labels = torch.randint(0, 10, (count,), generator=generator)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        return (self.transform(image) if self.transform else image), int(self.labels[index])


class _Compose:
    def __init__(self, steps: list[Any]) -> None:
        self.steps = steps

    def __call__(self, value: Any) -> Any:
        for step in self.steps:
            value = step(value)
        return value


class _Normalize:
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


def mnist_stub(train: int, test: int) -> dict[str, Any]:
    """What a ``torchvision`` stub needs for PyTorch's MNIST examples (``stub_missing({"torchvision": ...})``):
    ``datasets.MNIST`` holds ``train`` / ``test`` images of seeded noise with seeded labels, and ``transforms``
    apply ``Normalize`` as torchvision does to a tensor (``ToTensor`` is the identity: the images are tensors)."""
    _MNIST.sizes = (train, test)
    datasets = types.SimpleNamespace(MNIST=_MNIST)
    transforms = types.SimpleNamespace(Compose=_Compose, ToTensor=lambda: lambda image: image, Normalize=_Normalize)
    return {"datasets": datasets, "transforms": transforms}


def full_state_dicts_without_offload() -> None:
    """``FSDP.state_dict_type`` given ``FullStateDictConfig(offload_to_cpu=True, ...)`` takes it without the
    offload, which means nothing on the CPU: with the shards there, FSDP1's ``FlatParamHandle.to_cpu()`` "moves"
    the gathered flat parameter to where it already is and frees that storage, which the state dict's views
    still point to (pytorch/pytorch issue 188989: a segmentation fault on rank 0). Only FSDP1 code calls it."""
    from torch.distributed.fsdp import FullStateDictConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state_dict_type = FSDP.state_dict_type

    def on_the_cpu_already(module: Any, kind: Any, state_dict_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(state_dict_config, FullStateDictConfig) and state_dict_config.offload_to_cpu:
            state_dict_config = FullStateDictConfig(offload_to_cpu=False, rank0_only=state_dict_config.rank0_only)
        return state_dict_type(module, kind, state_dict_config, *args, **kwargs)

    FSDP.state_dict_type = staticmethod(on_the_cpu_already)  # type: ignore[assignment]


def full_optim_state_dicts_without_offload() -> None:
    """``FSDP.optim_state_dict`` under a full type whose optimizer config offloads to the CPU (FSDP1's default
    ``FullOptimStateDictConfig()`` included) takes it without the offload, which means nothing on the CPU: with
    ``use_orig_params=True`` and the shards on the CPU, FSDP1's "offloaded" copy of ``exp_avg`` is read after its
    storage is reused, and the saved ``exp_avg`` values are wrong (``exp_avg_sq`` and the weights right; 2 gloo
    ranks, AdamW, torch 2.13: up to 0.7 apart from a single-process reference, exact without the offload). Only
    FSDP1 code calls it."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    optim_state_dict = FSDP.optim_state_dict

    def on_the_cpu_already(model: Any, optim: Any, *args: Any, **kwargs: Any) -> Any:
        settings = FSDP.get_state_dict_type(model)
        config = settings.optim_state_dict_config
        if settings.state_dict_type != StateDictType.FULL_STATE_DICT or not config.offload_to_cpu:
            return optim_state_dict(model, optim, *args, **kwargs)
        kept = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=getattr(config, "rank0_only", False))
        FSDP.set_state_dict_type(model, settings.state_dict_type, settings.state_dict_config, kept)
        try:
            return optim_state_dict(model, optim, *args, **kwargs)
        finally:
            FSDP.set_state_dict_type(model, settings.state_dict_type, settings.state_dict_config, config)

    FSDP.optim_state_dict = staticmethod(on_the_cpu_already)  # type: ignore[assignment]
