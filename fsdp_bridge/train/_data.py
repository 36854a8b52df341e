"""Training data: read text or JSONL files, tokenize, pack into sequences, shard by rank.

Documents are tokenized, joined with the EOS token and cut into sequences of
``data.seq_len`` tokens.  The last ``data.eval_sequences`` sequences are held out.
Training order is a seeded permutation per epoch over the global sample stream; rank
``r`` takes its slice of each micro-batch.  The whole position is one integer, the
number of samples consumed by all ranks, so a resumed run continues exactly where the
checkpoint left off (and at any world size).
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.train._config import SAMPLE, DataConfig

__all__ = ["PackedData", "read_documents", "resolve_files", "sample_corpus_path"]


def sample_corpus_path() -> Path:
    """The small English corpus shipped inside the package."""
    return Path(__file__).resolve().parents[1] / "data" / "sample_corpus.txt"


def resolve_files(config: DataConfig) -> list[Path]:
    """The files named by ``data.files`` (globs expanded, sorted), or ConfigError naming what matched nothing."""
    files: list[Path] = []
    problems: list[Problem] = []
    for entry in config.files:
        if entry == SAMPLE:
            files.append(sample_corpus_path())
            continue
        matches = sorted(glob.glob(str(Path(entry).expanduser()), recursive=True))
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            problems.append(
                Problem(
                    "data.files",
                    entry,
                    "existing .txt or .jsonl files or glob patterns, or 'sample'",
                    "check the path (relative paths are relative to the working directory)",
                )
            )
        for m in matches:
            if Path(m).suffix not in (".txt", ".jsonl", ".md"):
                problems.append(Problem("data.files", m, "files ending in .txt, .md or .jsonl"))
        files.extend(Path(m) for m in matches)
    if problems:
        raise ConfigError(problems)
    return files


def read_documents(config: DataConfig) -> list[str]:
    """One string per document: a whole .txt/.md file, or the ``text_key`` of each JSONL line."""
    docs: list[str] = []
    for path in resolve_files(config):
        if path.suffix == ".jsonl":
            with path.open() as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ConfigError(
                            [Problem("data.files", f"{path}:{lineno}", "one JSON object per line", str(err))]
                        ) from None
                    text = record.get(config.text_key) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        keys = sorted(record) if isinstance(record, dict) else "-"
                        raise ConfigError(
                            [
                                Problem(
                                    "data.text_key",
                                    config.text_key,
                                    f"a key holding a string in every record of {path}",
                                    f"line {lineno} has keys {keys}",
                                )
                            ]
                        )
                    docs.append(text)
        else:
            docs.append(path.read_text())
    return docs


@dataclass
class PackedData:
    """Packed train/held-out sequences and this rank's view of them."""

    train: torch.Tensor
    """[n_train, seq_len] token ids."""
    held_out: torch.Tensor
    """[n_eval, seq_len] token ids, n_eval a multiple of the world size."""
    seed: int
    rank: int
    world_size: int
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, docs: list[str], tokenizer: Any, config: DataConfig, *, seed: int, rank: int, world_size: int
    ) -> PackedData:
        ids: list[int] = []
        eos = int(tokenizer.eos_token_id)
        encoded = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
        for doc in encoded:
            ids.extend(doc)
            ids.append(eos)
        n_seq = len(ids) // config.seq_len
        stream = torch.tensor(ids[: n_seq * config.seq_len], dtype=torch.long).view(n_seq, config.seq_len)
        n_eval = (config.eval_sequences // world_size) * world_size
        if config.eval_sequences and n_eval == 0:
            raise ConfigError(
                [Problem("data.eval_sequences", config.eval_sequences, f"0 or at least the world size ({world_size})")]
            )
        n_train = n_seq - n_eval
        if n_train < 1:
            raise ConfigError(
                [
                    Problem(
                        "data.seq_len",
                        config.seq_len,
                        f"a length that leaves training sequences ({len(ids)} tokens make {n_seq} sequences, "
                        f"{n_eval} held out)",
                        "use more data, a smaller seq_len or fewer eval_sequences",
                    )
                ]
            )
        return cls(train=stream[:n_train], held_out=stream[n_train:], seed=seed, rank=rank, world_size=world_size)

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.train), generator=g)}
        return self._perms[epoch]

    def micro_batch(self, position: int, micro_batch_size: int) -> torch.Tensor:
        """This rank's sequences of the micro-batch that starts at global sample ``position``.

        The micro-batch covers samples ``position .. position + world * mbs``; the caller
        advances ``position`` by ``world * mbs`` after each one.
        """
        n = len(self.train)
        start = position + self.rank * micro_batch_size
        rows = []
        for i in range(start, start + micro_batch_size):
            rows.append(int(self._perm(i // n)[i % n]))
        return self.train[rows]

    def eval_batches(self, micro_batch_size: int) -> list[torch.Tensor]:
        """This rank's share of the held-out sequences (every rank gets as many batches)."""
        mine = self.held_out[self.rank :: self.world_size]
        return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
