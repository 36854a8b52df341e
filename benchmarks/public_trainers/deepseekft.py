"""Drives the FSDP1 LoRA fine-tuning script of InterUniverse/deepseek-fine-tuning (``fsdp.py`` at e40796c) on CPU
ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the repository and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/deepseekft.py

The script loads a causal LM in bf16 from ``/data/<--dataset-id>`` on rank 0 and on the meta device elsewhere, adds
PEFT LoRA adapters to its attention projections, wraps it in ``FSDP(model, auto_wrap_policy=partial(
size_based_auto_wrap_policy, min_num_params=1_000), sharding_strategy=FULL_SHARD, mixed_precision=<bf16 parameters,
reduction and buffers>, cpu_offload=CPUOffload(offload_params=True), device_id=..., param_init_fn=<to_empty>,
sync_module_states=True, device_mesh=<1-D mesh>)``, and trains five epochs with AdamW, saving a DCP checkpoint
(``get_state_dict`` through a ``Stateful``) every second step. This driver runs it as ``__main__`` with what it
reads from elsewhere made here, the same in both runs:

* the model is a 2-layer Qwen2 (the family of DeepSeek-R1's Qwen distillations) with a byte-level BPE tokenizer
  trained on the sample text shipped with fsdp_bridge, saved per rank (seeded: the same files) where the script's
  ``--dataset-id`` points;
* the dataset (``datasets.load_dataset`` of a hub dataset) is 16 question/answer pairs cut from that text;
* ``cycling_utils`` (not on PyPI) is a stand-in: a ``DistributedSampler`` with the methods the script calls
  (``advance``, ``reset_progress``, its state), a checkpoint directory per save step, a timer that prints;
* the script's check for a CUDA bf16 machine passes on the CPU; ``looseversion`` is a stub when not installed;
* offload is off in every run (FSDP1's ``CPUOffload`` pins host memory, which needs an accelerator); FSDP1's
  ``sync_module_states`` broadcasts rank 0's weights from the CPU (its check that they are on a GPU skipped);
* on the meta ranks the model is built from its config (transformers 5 refuses ``from_pretrained`` under a meta
  device, which 4.48, the script's, allowed: the same meta parameters); every run's tokenizer pads to 32 tokens
  (the script asks for 512).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

import torch
import torch.distributed.fsdp as fsdp
import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1_module
from _common import sample_sentences, save_sample_tokenizer, stub_missing

SEQUENCE = 32


def _save_tiny_qwen2(directory: str) -> None:
    import transformers

    tokenizer = save_sample_tokenizer(directory, pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)


class _Rows(list):  # type: ignore[type-arg]
    """What ``datasets.load_dataset`` gives the script: rows with ``column_names`` and a batched ``map``."""

    column_names = ("input_text", "target_text")

    def map(self, fn: Any, batched: bool = True, remove_columns: Any = None, desc: str = "") -> list[dict[str, Any]]:
        encoded = fn({name: [row[name] for row in self] for name in self.column_names})
        return [{key: values[i] for key, values in encoded.items()} for i in range(len(self))]


def _load_dataset(*args: Any, **kwargs: Any) -> _Rows:
    sentences = sample_sentences()[:32]
    return _Rows({"input_text": sentences[i], "target_text": sentences[i + 1]} for i in range(0, 32, 2))


class _Sampler(torch.utils.data.DistributedSampler):  # type: ignore[type-arg]
    """cycling_utils' InterruptableDistributedSampler, as far as the script uses it (no shuffling)."""

    def __init__(self, dataset: Any) -> None:
        super().__init__(dataset, shuffle=False)
        self.progress = 0

    def advance(self, n: int) -> None:
        self.progress += n

    def reset_progress(self) -> None:
        self.progress = 0

    def state_dict(self) -> dict[str, int]:
        return {"progress": self.progress, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.progress, self.epoch = state["progress"], state["epoch"]


class _Directory:
    """cycling_utils' AtomicDirectory: a new directory per save step, ``latest`` pointing at the last one."""

    symlink_name = "latest"

    def __init__(self, output_directory: str, is_master: bool) -> None:
        self.root, self.master, self.count = output_directory, is_master, 0

    def prepare_checkpoint_directory(self) -> str:
        self.count += 1
        path = os.path.join(self.root, f"CHK{self.count}")
        os.makedirs(path, exist_ok=True)
        return path

    def atomic_symlink(self, path: str) -> None:
        if self.master:
            link = os.path.join(self.root, self.symlink_name)
            if os.path.islink(link):
                os.unlink(link)
            os.symlink(path, link)


class _NoOffload(fsdp.CPUOffload):
    """FSDP1's ``CPUOffload(...)`` with nothing offloaded (a class still: the bridge tests values against it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(offload_params=False)


class _Timer:
    def __init__(self, *args: Any) -> None:
        pass

    def report(self, text: str) -> None:
        print(text, flush=True)


def main() -> None:
    stub_missing(
        {
            "cycling_utils": {
                "atomic_torch_save": torch.save,
                "AtomicDirectory": _Directory,
                "TimestampedTimer": _Timer,
                "InterruptableDistributedSampler": _Sampler,
            },
            "looseversion": {"LooseVersion": str},
            "datasets": {"load_dataset": _load_dataset},
        }
    )
    import datasets

    datasets.load_dataset = _load_dataset  # installed or not: the script's is this driver's
    rank = int(os.environ["RANK"])
    model_dir = os.path.abspath(f"tiny-qwen2-rank{rank}")
    _save_tiny_qwen2(model_dir)
    import fsdp_utils

    fsdp_utils.bfSixteen_ready = lambda: True
    if not torch.cuda.is_available():
        fsdp.CPUOffload = fsdp1_module.CPUOffload = _NoOffload  # type: ignore[misc]
        fsdp.CPUOffloadPolicy = lambda *args, **kwargs: fsdp.OffloadPolicy()  # type: ignore[misc]
        # FSDP1's sync_module_states refuses CPU weights ("requires them to be on GPU"), a check before a broadcast
        # gloo makes from the CPU; FSDP1's run alone reaches it
        from torch.distributed.fsdp import _init_utils

        _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    import transformers

    encode = transformers.PreTrainedTokenizerFast.__call__

    def shorter(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("max_length") == 512:
            kwargs["max_length"] = SEQUENCE
        return encode(self, *args, **kwargs)

    transformers.PreTrainedTokenizerFast.__call__ = shorter  # type: ignore[method-assign]
    load = transformers.AutoModelForCausalLM.from_pretrained

    def on_meta(path: str, *args: Any, **kwargs: Any) -> Any:
        if torch.empty(0).device.type != "meta":
            return load(path, *args, **kwargs)
        # the meta ranks: transformers 5 refuses from_pretrained under a meta device (4.48, the script's, built the
        # model there with meta parameters): the same model from its config
        config = transformers.AutoConfig.from_pretrained(path, use_cache=kwargs.get("use_cache", True))
        return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=kwargs.get("torch_dtype"))

    transformers.AutoModelForCausalLM.from_pretrained = on_meta  # type: ignore[method-assign]
    sys.argv = ["fsdp.py", "--dataset-id", model_dir, "--chk-path", os.path.abspath("checkpoints")]
    os.makedirs("checkpoints", exist_ok=True)
    runpy.run_path("fsdp.py", run_name="__main__")


if __name__ == "__main__":
    main()
