"""Drives the FSDP1 trainer of minhaeoh/FM_KD (``train_fsdp.py`` at 9423e0f) on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the checkout and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/fmkd.py

The trainer distils a teacher LLM into a flow-matching student: its ``StudentCFD`` (``student_model/model.py``)
is a ``LlamaForCausalLM`` built from the teacher's config with fewer layers, conditioned on the time by a
sinusoidal embedder and an adaLN modulation per layer, and trained to carry the hidden states of the answer
tokens from a learned mask embedding plus noise through the teacher's anchor layers: ``train.compute_losses``
draws an interval and a time in it per sample, interpolates between the two anchors and regresses the velocity
(flow matching) and the interval's endpoint (anchor loss). ``train_fsdp.py`` builds the student, loads its
init checkpoint (``--student-init-ckpt``, made once from the teacher by ``init_student_from_teacher.py``), casts
it and a ``MaskInit`` to bf16, wraps both in one module, applies non-reentrant activation checkpointing to every
``LlamaDecoderLayer`` and wraps the module in one ``FSDP(...)``: a ``transformer_auto_wrap_policy`` over
``LlamaDecoderLayer``, ``MixedPrecision`` in bf16 (parameters, reduction, buffers), ``FULL_SHARD``,
``BACKWARD_PRE``, ``limit_all_gathers``, ``use_orig_params=False``, ``device_id=torch.device("cuda:<local
rank>")``. It trains with AdamW over the wrapped module's parameters (weight decay 0.01 on all of them), clips
with ``torch.nn.utils.clip_grad_norm_(fsdp_model.parameters(), 1.0)``, all-reduces the loss terms for its log
and its loss balancer, and saves checkpoints every half epoch and at the end as full state dicts under
``FSDP.state_dict_type(..., FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))``: the model, ``FSDP.optim_state_dict`` and its
config, one ``torch.save`` on rank 0 (``checkpoints_cfd/<time>/cfd_poc/step_<N>/checkpoint.pt``, which
``verify`` compares). This driver runs its ``train_fsdp.py`` as ``__main__`` with its own command line: bf16
and activation checkpointing (the trainer's defaults and ``script/train.bash``'s), no KL term (``lambda_kl`` 0,
the default and ``train.bash``'s), batches of 2 samples per rank of at most 16 tokens (``--max-length``), 4
intervals (``--num-intervals``: the anchors the data holds), a student of 2 layers, 4 optimizer steps, which are
one epoch (4 losses per rank), a learning rate of 1e-3 (``--lr``: the default 2e-5 is below half a bf16 step of
most weights, which would then not move), a log line every step, no wandb; the default half-epoch saves give
checkpoints at step 2 and step 4 (the final save writes step 4 again). Arguments given to the driver are
appended to that command line (the trainer's parser takes the last value). What the trainer reads from
elsewhere is made here, the same on every rank, in a folder of the run's tree for each rank
(``fmkd-inputs-rank<N>``, removed when the run ends), named by a path relative to it: the checkpoint's config
records the data, teacher and init-checkpoint paths, and they are then the same in both runs:

* the teacher (``--teacher-model-id``, ``meta-llama/Meta-Llama-3.1-8B-Instruct``, a hub download read by
  ``AutoConfig`` and ``AutoModelForCausalLM.from_pretrained``) is a ``LlamaForCausalLM`` of 4 layers of 64
  dimensions, 4 heads and 2 key/value heads (Llama 3's grouped queries), a vocabulary of 128, its weights drawn
  from a seeded generator, saved by ``save_pretrained``;
* the student's init checkpoint is made by the project's own ``init_student_from_teacher.py``, run as
  ``__main__`` on the CPU from that teacher (seeded alike on every rank: the time embedder's weights are drawn,
  the rest is copied from the teacher's embedding, head, final norm and layers 0 and 2, its ``uniform`` layer
  map for 4 teacher and 2 student layers, the ``odd`` map's fallback);
* its data (``--data-root``: ``shard_<gpu>/chunk_*.safetensors`` written by ``dataset/collect_data.py`` from
  MetaMathQA and the teacher) are 16 samples in two shards of 8 in that format: token ids drawn from a seeded
  generator (a BOS token, then 9 to 15 tokens, the question the first 3 to ``len - 3``), and for each the
  teacher's hidden states (``output_hidden_states``: the embedding and the 4 layers, the last after the final
  norm, the collector's ``[0] + ANCHOR_LAYERS`` in miniature: 4 anchors) in fp16, the question length, the ids,
  and the teacher's top-8 logits of the answer tokens (fp16 values, int32 indices: the collector's top-k
  format, which the trainer loads and, with ``lambda_kl`` 0, does not use). No tokenizer is needed;
* ``ModelConfig.time_embedding_dim`` (4096, the hidden size of the 8B teacher) is the miniature teacher's
  hidden size, 64, in both the init checkpoint and the trainer (its comment: "overridden by teacher
  hidden_size"); at 4096 the time embedder alone would hold 17M parameters;
* the run's output folder is named by ``time.strftime("%Y%m%d_%H%M")``: here the same time in both runs, so
  that ``verify`` finds the two runs' checkpoints at the same path;
* it is written for CUDA devices, and here they are the CPU, alike in both runs: FSDP1's ``device_id`` is
  ``torch.device("cuda:<local rank>")``, which ``verify``'s shims take as the CPU (in ``FullyShardedDataParallel``
  and in the migrated ``fsdp_bridge.BridgeConfig.from_fsdp1``, which keeps the argument). The trainer's
  ``torch.autocast("cuda", bf16)`` switches itself off on a machine without CUDA, in both runs (the model is in
  bf16 already);
* its checkpoints take the full state dict with ``offload_to_cpu=True``: with the shards on the CPU, FSDP1's
  ``FlatParamHandle.to_cpu()`` "moves" the gathered flat parameter to where it already is (no copy) and then
  frees that storage, which the state dict's views still point to (pytorch/pytorch issue 188989, as in
  ``allamo.py``). Here ``FSDP.state_dict_type`` takes such a config without the offload, which means nothing on
  the CPU (only the FSDP1 run calls it; the migrated code takes the state dicts with ``get_model_state_dict``
  and ``get_optimizer_state_dict``); ``FMKD_KEEP_OFFLOAD=1`` keeps it.

bf16 as the trainer has it (weights, ``MixedPrecision``); the total loss is a float32 tensor (the time, drawn in
float32, reaches the anchor loss), compared with float32's tolerance. The losses agree (at most 2.4e-4 apart, of
575), but the saved files do not: DIVERGED, with both targets, for two changes the migration makes, which this
driver leaves as they are:

* ``torch.nn.utils.clip_grad_norm_(fsdp_model.parameters(), 1.0)`` (``train_fsdp.py``, in the loop) takes the
  norm of each rank's flat-parameter shards on FSDP1 and of the whole model's DTensors on FSDP2 (the ``--fix``
  report notes it): 41.5 on rank 0 and 121.5 on rank 1 against 128 at step 1. Every step clips, so FSDP1 scales
  each rank's shards by its own factor, and 85 of the 121 saved tensors differ at step 2 (by up to 0.026).
  FSDP1's own ``fsdp_model.clip_grad_norm_`` would clip by the global norm, as the migrated code does;
* FSDP1 without ``use_orig_params`` reduces each unit's whole flat gradient, so every parameter of a unit has a
  gradient (zero where the step did not use it) and AdamW steps it; FSDP2 gives one only to the parameters the
  step used, and AdamW skips the others. The head (``lm_head``: no CE or KL term) has AdamW state after FSDP1
  (zeros, with weight decay applied) and none after the migration ("saved by FSDP1 only"). ``MaskInit.mask``
  enters the loss only when a sample draws interval 0 (``train.compute_losses``: ``a[is0] = z0[is0]``): here
  both ranks draw it at steps 1 and 2 and neither at steps 3 and 4, where FSDP1 keeps moving it by its momentum
  (AdamW ``step`` 4) and FSDP2 leaves it (``step`` 2), so the mask differs at step 4. When one rank draws
  interval 0 and the other does not, the ranks' FSDP2 reduce-scatters differ in size: with ``--seed 1`` or
  ``--seed 2`` given to this driver the migrated run fails at its first step (gloo: "Received data size doesn't
  match expected size", 37376 vs 37344; NCCL would hang), while FSDP1 trains.

With ``--grad-clip 0`` given to this driver and ``set_reduce_scatter_unused_params(True)`` (torch 2.13) called on
the migrated model after ``fsdp_bridge.shard`` (neither done here), the losses and all 124 saved tensors agree bit
for bit, at seed 42 and seed 1.
"""

from __future__ import annotations

import atexit
import os
import runpy
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from _common import full_state_dicts_without_offload

SEED = 1234
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, INTERMEDIATE = 64, 4, 4, 2, 128, 128
BOS, EOS = 1, 2
STUDENT_LAYERS = 2
ANCHOR_LAYERS = [1, 2, 3, 4]
"""The teacher's hidden states saved as anchors (``hidden_states`` index; 0 is the embedding, also saved)."""
SHARDS, SAMPLES_PER_SHARD = 2, 8
MIN_TOKENS, MAX_TOKENS = 10, 16
TOPK = 8
STAMP = time.struct_time((2025, 1, 1, 0, 0, 0, 2, 1, 0))
"""The time ``train_fsdp.py`` names its output folder by."""


def _inputs_folder() -> str:
    """This rank's folder of made-up inputs, relative to the run's tree (removed when the run ends)."""
    folder = f"fmkd-inputs-rank{os.environ.get('RANK', '0')}"
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _teacher(directory: str) -> Any:
    """The miniature teacher, saved by ``save_pretrained`` to ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2 * MAX_TOKENS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    teacher = LlamaForCausalLM(config).eval()
    teacher.save_pretrained(directory)
    return teacher


@torch.no_grad()
def _data(teacher: Any, directory: str) -> None:
    """16 samples in ``dataset/collect_data.py``'s layout (see the module docstring)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(SEED)
    layers = [0, *ANCHOR_LAYERS]
    for shard in range(SHARDS):
        os.makedirs(os.path.join(directory, f"shard_{shard}"))
        buffer: dict[str, torch.Tensor] = {}
        for sid in range(shard * SAMPLES_PER_SHARD, (shard + 1) * SAMPLES_PER_SHARD):
            seq_len = int(torch.randint(MIN_TOKENS, MAX_TOKENS + 1, (1,), generator=generator))
            q_len = int(torch.randint(3, seq_len - 2, (1,), generator=generator))
            ids = torch.cat([torch.tensor([BOS]), torch.randint(3, VOCAB, (seq_len - 1,), generator=generator)])
            out = teacher(input_ids=ids[None], output_hidden_states=True)
            hidden = torch.stack(out.hidden_states, dim=0)[layers, 0]
            vals, idx = torch.topk(out.logits[0, q_len:seq_len], k=TOPK, dim=-1)
            buffer[f"sample_{sid}_hidden"] = hidden.to(torch.float16).contiguous()
            buffer[f"sample_{sid}_qlen"] = torch.tensor([q_len], dtype=torch.long)
            buffer[f"sample_{sid}_input_ids"] = ids
            buffer[f"sample_{sid}_teacher_logits_topk_vals"] = vals.to(torch.float16).contiguous()
            buffer[f"sample_{sid}_teacher_logits_topk_idx"] = idx.to(torch.int32).contiguous()
        save_file(buffer, os.path.join(directory, f"shard_{shard}", "chunk_0_final.safetensors"))


def _time_embedding_of_the_teacher() -> None:
    """``ModelConfig.time_embedding_dim`` is the miniature teacher's hidden size (see the module docstring)."""
    import configs.model_config as model_config

    @dataclass
    class ModelConfig(model_config.ModelConfig):  # type: ignore[misc,valid-type]
        time_embedding_dim: int = HIDDEN

    model_config.ModelConfig = ModelConfig


def _student_init(teacher_dir: str, path: str) -> None:
    """The project's ``init_student_from_teacher.py`` writes the student's init checkpoint to ``path``."""
    argv = sys.argv
    sys.argv = [
        "init_student_from_teacher.py",
        *("--output", path, "--device", "cpu", "--teacher-model-id", teacher_dir),
        *("--student-num-layers", str(STUDENT_LAYERS), "--layer-copy-mode", "odd"),
    ]
    torch.manual_seed(SEED)
    try:
        runpy.run_path("init_student_from_teacher.py", run_name="__main__")
    finally:
        sys.argv = argv


def _same_stamp() -> None:
    """``time.strftime`` called by ``train_fsdp.py`` without a time formats ``STAMP``."""
    strftime = time.strftime

    def stamped(fmt: str, t: Any = None) -> str:
        if t is None and sys._getframe(1).f_globals.get("__name__") == "__main__":
            t = STAMP
        return strftime(fmt) if t is None else strftime(fmt, t)

    time.strftime = stamped  # type: ignore[assignment]


def main() -> None:
    folder = _inputs_folder()
    teacher_dir = os.path.join(folder, "teacher")
    data_root = os.path.join(folder, "collected_data")
    init_ckpt = os.path.join(folder, "student_init.pt")
    _data(_teacher(teacher_dir), data_root)
    _time_embedding_of_the_teacher()
    _student_init(teacher_dir, init_ckpt)

    _same_stamp()
    if os.environ.get("FMKD_KEEP_OFFLOAD") != "1":
        full_state_dicts_without_offload()
    sys.argv = [
        "train_fsdp.py",
        *("--student-init-ckpt", init_ckpt, "--data-root", data_root, "--teacher-model-id", teacher_dir),
        *("--student-num-layers", str(STUDENT_LAYERS), "--num-intervals", str(len(ANCHOR_LAYERS))),
        *("--batch-size", "2", "--num-workers", "0", "--max-length", str(MAX_TOKENS)),
        *("--lr", "1e-3", "--max-steps", "4", "--log-every", "1", "--no-wandb"),
        *sys.argv[1:],
    ]
    runpy.run_path("train_fsdp.py", run_name="__main__")


if __name__ == "__main__":
    main()
