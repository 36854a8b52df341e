"""Peak host memory and time per rank: pretrained weights into a sharded model, and back out.

    python benchmarks/pretrained_memory.py --world-size 2 --hidden 768 --layers 6
    python benchmarks/pretrained_memory.py --world-size 2 --hidden 768 --layers 6 --lora 8   # LoRA on q/v

Methods, each in fresh processes on ``--world-size`` gloo CPU ranks (FSDP2 unless ``--backend``):

- ``naive``: every rank runs ``AutoModelForCausalLM.from_pretrained`` (a whole model per rank),
  then ``fsdp_bridge.shard``;
- ``load_pretrained``: ``fsdp_bridge.load_pretrained`` builds the model on the meta device,
  shards it, and each rank reads only the slices of the safetensors files its shards hold;

and ``from_pretrained`` on one process (the wall-time target) for reference.  Then, from the
sharded model, a Hugging Face export two ways:

- ``gather (torch)``: torch's full state dict (``get_model_state_dict`` with
  ``full_state_dict=True, cpu_offload=True``: the whole model gathered on rank 0; FSDP1 on CPU
  without ``cpu_offload``, which crashes there, so on every rank), written by rank 0;
- ``save_checkpoint(kind="full")``: each rank writes its slices and rank 0 assembles the files one
  tensor at a time (FSDP1: each rank writes its flat shard's ranges straight into the files).

With ``--optimizer`` the exports also write AdamW's full state (after one step on a small batch);
the target then counts the moments: (3 x model/N + 3 x the largest unit) x 1.1.

Memory: the process's anonymous resident memory (``RssAnon``: what it owns; file pages the
safetensors memory maps bring in are shared page cache, reclaimable, and not counted), sampled
every millisecond during the load, peak minus the value before it, per rank; the target is
(model/N + the largest wrap unit) x 1.1 (for the exports: the peak above the memory before the
load, so the shards count).  The kernel's ``VmHWM`` peak (which also counts mapped file pages) is
printed beside it for the loads.  Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import threading
import time
from pathlib import Path


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"no {field} in /proc/self/status")


class _AnonPeak:
    """Peak RssAnon (MiB) while the block runs, sampled by a thread."""

    def __enter__(self) -> _AnonPeak:
        self.base = self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _lora(model: object, r: int) -> object:
    """``model`` with LoRA adapters of rank ``r`` on q_proj/v_proj (``r`` 0: as it is)."""
    if not r:
        return model
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=["q_proj", "v_proj"]))  # type: ignore[arg-type]


def _run(method: str, path: str, backend: str, with_optimizer: bool = False, lora: int = 0) -> dict[str, float]:
    import torch  # (imports count towards the baseline, not the load)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import fsdp_bridge

    if lora:
        import peft  # noqa: F401  (its imports, bitsandbytes' among them, count towards the baseline)

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    config = fsdp_bridge.BridgeConfig(backend=backend, wrap="auto", device="cpu")
    hf_config = AutoConfig.from_pretrained(path)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    hwm_base = _status("VmRSS")
    start = time.perf_counter()
    with _AnonPeak() as anon:
        if method == "from_pretrained":
            model = _lora(AutoModelForCausalLM.from_pretrained(path), lora)
        elif method == "naive":
            model = fsdp_bridge.shard(_lora(AutoModelForCausalLM.from_pretrained(path), lora), config)
        else:
            model = fsdp_bridge.load_pretrained(
                lambda: _lora(AutoModelForCausalLM.from_config(hf_config), lora), path, config
            )
    seconds = time.perf_counter() - start
    if not method.startswith("export"):
        return {"anon": anon.peak - anon.base, "hwm": _status("VmHWM") - hwm_base, "seconds": seconds}
    out = Path(path).parent / method
    optimizer = None
    if with_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, hf_config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the load freed goes back to the OS, not into this figure
    dist.barrier()
    start = time.perf_counter()
    with _AnonPeak() as export:
        if method == "export_gather":
            # cpu_offload (gather on rank 0 only) crashes FSDP1 on CPU in torch 2.13: every rank gathers.
            offload = backend == "fsdp2"
            options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
            full = get_model_state_dict(model, options=options)
            osd = get_optimizer_state_dict(model, optimizer, options=options) if optimizer else None
            if dist.get_rank() == 0:
                AutoModelForCausalLM.from_config(hf_config).save_pretrained(out, state_dict=full)
                if osd is not None:
                    torch.save(osd, out / "optimizer.pt")
            del full, osd
        else:
            fsdp_bridge.save_checkpoint(out, model, optimizer, kind="full")
        dist.barrier()
    # The peak above the memory before the load: the shards count.
    return {"anon": export.peak - anon.base, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--backend", choices=("fsdp1", "fsdp2"), default="fsdp2")
    parser.add_argument("--max-shard-size", default="5GB", help="save_pretrained's file size (indexed above it)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on q_proj/v_proj for the loads (0: none)")
    parser.add_argument("--optimizer", action="store_true", help="the exports also write AdamW's full state")
    args = parser.parse_args()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

    from transformers import AutoModelForCausalLM, LlamaConfig

    from fsdp_bridge.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.hidden // 64),
            vocab_size=args.vocab,
            tie_word_embeddings=False,
        )
        model = AutoModelForCausalLM.from_config(cfg)
        total = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()) / 2**20
        unit = max(layer, total - args.layers * layer)  # a decoder layer, or the root's own parameters
        model_dir = str(Path(tmp) / "model")
        model.save_pretrained(model_dir, max_shard_size=args.max_shard_size)
        del model
        files = list(Path(model_dir).glob("*.safetensors"))
        n = args.world_size
        target = (total / n + unit) * 1.1
        print(
            f"Llama {args.layers}x{args.hidden}, vocab {args.vocab}: {total:.0f} MiB of fp32 parameters in "
            f"{len(files)} safetensors file(s); largest wrap unit {unit:.0f} MiB; {args.backend}, world size {n}; "
            f"{f'LoRA r={args.lora} on q_proj/v_proj (the loads); ' if args.lora else ''}"
            f"target (model/N + unit) x 1.1 = {target:.0f} MiB"
        )
        print(f"{'method':<16} {'rank':>4} {'RssAnon peak MiB':>17} {'/ target':>9} {'VmHWM MiB':>10} {'seconds':>8}")
        reference = run_distributed(
            _run, 1, args=("from_pretrained", model_dir, args.backend, False, args.lora), timeout_s=900
        )[0]
        print(
            f"{'from_pretrained':<16} {'(1)':>4} {reference['anon']:>17.0f} {'':>9} "
            f"{reference['hwm']:>10.0f} {reference['seconds']:>8.2f}"
        )
        for method in ("naive", "load_pretrained"):
            results = run_distributed(_run, n, args=(method, model_dir, args.backend, False, args.lora), timeout_s=900)
            for rank, r in enumerate(results):
                print(
                    f"{method:<16} {rank:>4} {r['anon']:>17.0f} {r['anon'] / target:>9.2f} "
                    f"{r['hwm']:>10.0f} {r['seconds']:>8.2f}"
                )
            slowest = max(r["seconds"] for r in results)
            print(f"{'':<16} time / one-process from_pretrained: {slowest / reference['seconds']:.2f}")
        if args.optimizer:  # AdamW's two moments, sharded like the parameters
            target = (3 * total / n + 3 * unit) * 1.1
            print(f"\nwith AdamW's state: target (3 x model/N + 3 x unit) x 1.1 = {target:.0f} MiB")
        print(f"\n{'export':<24} {'rank':>4} {'RssAnon peak MiB':>17} {'/ target':>9} {'seconds':>8}")
        for method, label in (("export_gather", "gather (torch)"), ("export_save", 'save_checkpoint("full")')):
            run_args = (method, model_dir, args.backend, args.optimizer)
            results = run_distributed(_run, n, args=run_args, timeout_s=900)
            for rank, r in enumerate(results):
                print(f"{label:<24} {rank:>4} {r['anon']:>17.0f} {r['anon'] / target:>9.2f} {r['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
