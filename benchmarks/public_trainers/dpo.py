"""Drives the FSDP trainer of eric-mitchell/direct-preference-optimization on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the trainer's own tree and once in the
copy that ``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/dpo.py

It does what the trainer's ``train.py`` does before its workers start (that script is a Hydra entry
point that spawns one process per GPU): it builds the policy and the reference model with
``AutoModelForCausalLM.from_pretrained`` and calls ``train.worker_main`` on every rank, which builds
``trainers.FSDPTrainer`` (policy and reference model sharded, activation checkpointing, DPO loss,
evaluation with sampling under ``summon_full_params(recurse=False)``, full state dicts of the policy and
the optimizer saved with ``torch.save``) and trains. What the trainer reads from a hub is made here:

* the model is a 2-layer GPT-2 built from a config and saved to a temporary directory, the tokenizer a
  byte-level BPE trained on the sample text shipped in ``fsdp_bridge/data``;
* the preference data comes from that text (a prompt, a preferred and a rejected continuation), in the
  shape its ``get_dataset`` returns, in place of the hub datasets;
* the policy's training forwards run without a KV cache (``config.use_cache = False``; its generation
  still uses one): with transformers 5 a layer recomputed under torch's activation checkpointing appends
  to the cache object a second time and the recomputation fails, FSDP1 or not;
* ``random.seed`` takes numpy integers, as on the Python versions the trainer was written for (its data
  iterator seeds with them; Python 3.11 refuses them);
* modules it imports for what this run does not use (Hydra, OmegaConf, wandb, ``datasets``,
  BeautifulSoup, ``tensor_parallel``) are stubs when they are not installed.

fp32 throughout (``fsdp_policy_mp`` unset), so the two runs can agree bit for bit.
"""

from __future__ import annotations

import numbers
import os
import random
import tempfile
from types import SimpleNamespace

import torch
import transformers
from _common import sample_sentences, save_tiny_gpt2, stub_missing

STUBS = {
    "hydra": {"main": lambda **_: lambda fn: fn},
    "omegaconf": {"DictConfig": object, "OmegaConf": SimpleNamespace(register_new_resolver=lambda *a, **k: None)},
    "wandb": {"Table": lambda **_: SimpleNamespace(add_data=lambda *a: None), "init": None, "log": None},
    "datasets": {"logging": SimpleNamespace(disable_progress_bar=lambda: None, set_verbosity_error=lambda: None)},
    "bs4": {"BeautifulSoup": object, "NavigableString": object},
    "tensor_parallel": {},
}


def _preferences(split: str, **_: object) -> dict[str, dict[str, object]]:
    """Prompts with a preferred and a rejected continuation, in the shape ``get_dataset`` returns."""
    sentences = sample_sentences()
    start = 0 if split == "train" else len(sentences) // 2
    data: dict[str, dict[str, object]] = {}
    for i in range(start, start + 24):
        prompt = f"\n\nHuman: {sentences[i]}\n\nAssistant:"
        data[prompt] = {
            "responses": [" " + sentences[i + 1], " " + sentences[i + 2]],
            "pairs": [(0, 1)],
            "sft_target": " " + sentences[i + 1],
        }
    return data


def _seed_accepts_numpy_integers() -> None:
    seed = random.seed

    def accepting(a: object = None, version: int = 2) -> None:
        seed(int(a) if isinstance(a, numbers.Integral) else a, version)  # type: ignore[arg-type]

    random.seed = accepting  # type: ignore[assignment]


def main() -> None:
    _seed_accepts_numpy_integers()
    pretrained = tempfile.mkdtemp(prefix="dpo-pretrained-")
    save_tiny_gpt2(pretrained)
    stub_missing(STUBS)
    import preference_datasets
    import train
    from utils import disable_dropout

    preference_datasets.get_dataset = lambda name, split, **kw: _preferences(split, **kw)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = os.path.abspath("run")
    cache = os.path.abspath("cache")
    os.makedirs(cache, exist_ok=True)  # where its hub downloads would go (made by each rank otherwise: a race)
    config = SimpleNamespace(
        trainer="FSDPTrainer",
        seed=0,
        exp_name="parity",
        local_dirs=[cache],
        local_run_dir=run_dir,
        datasets=["synthetic"],
        debug=False,
        fsdp_port=int(os.environ["MASTER_PORT"]),
        wandb=SimpleNamespace(enabled=False),
        model=SimpleNamespace(
            name_or_path=pretrained,
            tokenizer_name_or_path=None,
            block_name="GPT2Block",
            fsdp_policy_mp=None,
            policy_dtype="float32",
            reference_dtype="float32",
            archive=None,
        ),
        loss=SimpleNamespace(name="dpo", beta=0.1, reference_free=False, label_smoothing=0.0),
        optimizer="RMSprop",
        lr=1e-3,
        warmup_steps=2,
        batch_size=8,
        eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=10.0,
        max_length=64,
        max_prompt_length=32,
        n_epochs=None,
        n_examples=48,
        n_eval_examples=8,
        n_eval_model_samples=4,
        eval_every=24,
        do_first_eval=True,
        sample_during_eval=True,
        minimum_log_interval_secs=0.0,
        activation_checkpointing=True,
    )
    policy = transformers.AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32)
    disable_dropout(policy)
    policy.config.use_cache = False  # see the docstring: activation checkpointing and transformers 5's cache
    reference = transformers.AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32)
    disable_dropout(reference)
    train.worker_main(rank, world, config, policy, reference)


if __name__ == "__main__":
    main()
