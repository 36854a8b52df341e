"""What rank 0 shows and records: a tqdm bar, ``metrics.jsonl`` and the final summary.

Verbosity: ``quiet`` prints only the summary; ``normal`` adds the bar, a header and
evaluation lines; ``verbose`` adds what each bridge option became and every checkpoint.
Disabled (``enabled=False``, the other ranks) it prints and writes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm

    from fsdp_bridge.train._loop import TrainResult

__all__ = ["Progress"]


class Progress:
    def __init__(
        self, metrics_path: Path, *, enabled: bool, verbosity: str, total: int, initial: int, resumed: bool
    ) -> None:
        self.enabled = enabled
        self.verbosity = verbosity
        self.metrics_path = metrics_path
        self._file = None
        self._bar: tqdm[Any] | None = None
        self._bar_args: dict[str, int] = {}
        if not enabled:
            return
        kept: list[str] = []
        if resumed and metrics_path.exists():
            # Keep the records up to the checkpoint; the steps after it are run again.
            for line in metrics_path.read_text().splitlines():
                if line.strip() and json.loads(line).get("step", 0) <= initial:
                    kept.append(line)
        self._file = metrics_path.open("w")
        for line in kept:
            self._file.write(line + "\n")
        self._file.flush()
        self._bar_args = dict(total=total, initial=initial)

    def _open_bar(self) -> None:
        if self._bar is None and self.enabled and self.verbosity != "quiet":
            from tqdm import tqdm  # only where a bar is shown

            self._bar = tqdm(
                **self._bar_args, unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=0.5, desc="train"
            )

    def _write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def header(self, line: str, *, detail: str, resumed: str | None) -> None:
        if not self.enabled or self.verbosity == "quiet":
            return
        self._write(line)
        if self.verbosity == "verbose":
            self._write(detail)
        if resumed:
            self._write(resumed)

    def note(self, text: str, *, verbose_only: bool = False) -> None:
        if self.enabled and (self.verbosity == "verbose" or (not verbose_only and self.verbosity == "normal")):
            self._write(text)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self._file is not None
        self._open_bar()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s "
                f"{record['step_time_s'] * 1000:.0f} ms/step mem {record['memory_mb']:,.0f} MB",
                refresh=False,
            )
            self._bar.update(1)
        if "eval_loss" in record:
            self.note(f"step {record['step']}: train loss {record['loss']:.4f}, eval loss {record['eval_loss']:.4f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self, result: TrainResult, *, exported: bool, lora: bool = False) -> None:
        if not self.enabled:
            return
        best = f"{result.best_eval_loss:.4f}" if result.best_eval_loss is not None else "-"
        final = f"{result.final_loss:.4f}" if result.final_loss is not None else "-"
        lines = [
            "",
            f"done: {result.steps} steps, {result.tokens:,} tokens, {result.wall_time_s:.1f} s wall time",
            f"  final train loss {final}, best eval loss {best}",
            f"  checkpoint: {result.checkpoint or 'none written'}",
            f"  metrics: {self.metrics_path}",
        ]
        if lora:
            if result.optimizer_bytes is not None and result.full_finetune_optimizer_bytes:
                lines.append(
                    f"  optimizer state on rank 0: {result.optimizer_bytes / 2**10:,.1f} KiB; full fine-tuning of the "
                    f"same model: {result.full_finetune_optimizer_bytes / 2**10:,.1f} KiB "
                    f"({result.optimizer_bytes / result.full_finetune_optimizer_bytes:.1%})"
                )
            lines.append(f"  adapter: {result.output_dir}/adapter (PeftModel.from_pretrained(base, path))")
            if exported:
                lines.append(f"  merged model: {result.output_dir}/merged (AutoModelForCausalLM.from_pretrained)")
        elif exported:
            lines.append(f"  model: {result.output_dir} (AutoModelForCausalLM.from_pretrained)")
        print("\n".join(lines), flush=True)
