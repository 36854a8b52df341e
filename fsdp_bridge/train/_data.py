"""Training data: read text or JSONL files, tokenize, pack into sequences, shard by rank.

Documents are tokenized, joined with the EOS token and cut into sequences of
``data.seq_len`` tokens.  The last ``data.eval_sequences`` sequences are held out, whatever
the world size.  Training order is a seeded permutation per epoch over the global sample
stream; rank ``r`` takes its slice of each micro-batch.  The whole position is one integer, the
number of samples consumed by all ranks, so a resumed run continues exactly where the
checkpoint left off, at any world size: the training sequences, their order and the position
do not depend on the number of ranks.
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
        # Independent of the world size: the training set (and so the order) is the same at any
        # number of ranks, which is what resuming at another world size relies on.
        n_eval = config.eval_sequences
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

    def sample_ids(self, position: int, count: int) -> list[int]:
        """The training sequences (rows of ``train``) at global samples ``position .. position + count``."""
        n = len(self.train)
        return [int(self._perm(i // n)[i % n]) for i in range(position, position + count)]

    def micro_batch(self, position: int, micro_batch_size: int) -> torch.Tensor:
        """This rank's sequences of the micro-batch that starts at global sample ``position``.

        The micro-batch covers samples ``position .. position + world * mbs``; the caller
        advances ``position`` by ``world * mbs`` after each one.
        """
        return self.train[self.sample_ids(position + self.rank * micro_batch_size, micro_batch_size)]

    def eval_batches(self, micro_batch_size: int) -> list[tuple[torch.Tensor, int]]:
        """This rank's share of the held-out sequences: ``(batch, rows that count)`` pairs.

        Rank ``r`` takes held-out rows ``r, r + world, ...``. Every rank gets as many batches of
        the same sizes (each forward is a collective under FSDP): where the held-out count is not a
        multiple of the world size, the ranks with one row fewer end with a copy of the first
        held-out row that does not count (its labels are masked by the caller).
        """
        n = len(self.held_out)
        if n == 0:
            return []
        per_rank = -(-n // self.world_size)
        mine = self.held_out[self.rank :: self.world_size]
        real = len(mine)
        if real < per_rank:
            mine = torch.cat([mine, self.held_out[:1].expand(per_rank - real, -1)])
        out = []
        for i in range(0, per_rank, micro_batch_size):
            batch = mine[i : i + micro_batch_size]
            out.append((batch, max(0, min(len(batch), real - i))))
        return out
