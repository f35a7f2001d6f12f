"""Text and a tokenizer that need no hub: Python's own documentation, byte by byte.

torchtitan's debug recipes read ``tests/assets/c4_test`` and ``tests/assets/tokenizer``, which
live in its repository, not in its wheel. The recipes here train on the standard library's
``pydoc_data.topics`` (79 topics of the language reference, about 465,000 characters) with
a byte-level tokenizer (256 bytes, then BOS and EOS), so they run from a fresh install with
no download.

- :class:`ByteTokenizer`: UTF-8 bytes as token ids.
- :class:`PydocTextDataLoader`: the topics tokenized, packed into ``seq_len`` windows, each
  data-parallel rank reading its own topics (every rank of every replica group: torchtitan's
  ``batch`` mesh), resumable from a checkpoint at any step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

__all__ = ["ByteTokenizer", "PydocTextDataLoader", "PydocTextDataset", "pydoc_documents"]

_BYTES = 256


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as token ids 0-255; BOS is 256, EOS 257 (vocabulary of 258, which fits
    the debug model's 2048)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None) -> None:
        # tokenizer_path: what torchtitan's Trainer passes every tokenizer (hf_assets_path); unused.
        super().__init__()
        self.bos_id = _BYTES
        self.eos_id = _BYTES + 1

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < _BYTES).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return _BYTES + 2


def pydoc_documents() -> list[str]:
    """The standard library's documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


class PydocTextDataset(IterableDataset, Stateful):
    """One data-parallel rank's share of :func:`pydoc_documents` (topics ``rank::world``),
    tokenized with BOS/EOS and packed into ``(input, label)`` windows of ``seq_len`` tokens,
    labels shifted by one inside each topic, with each token's position in its topic (the
    attention masks other topics out). Loops over its topics for as long as it is read.

    Its state (the topic to read next, the tokens read but not yet yielded, the pass) makes a
    resumed run read exactly what the uninterrupted one would have.
    """

    def __init__(self, tokenizer: BaseTokenizer, seq_len: int, dp_rank: int, dp_world_size: int) -> None:
        if seq_len < 1:
            raise ValueError(f"Invalid seq_len: {seq_len}")
        documents = pydoc_documents()
        if not 0 <= dp_rank < dp_world_size or dp_world_size > len(documents):
            raise ValueError(f"Invalid data-parallel rank {dp_rank} of {dp_world_size} ({len(documents)} topics)")
        self._documents = documents[dp_rank::dp_world_size]
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self._next = 0  # the topic to read next
        self._passes = 0
        self._inputs: list[int] = []
        self._labels: list[int] = []
        self._positions: list[int] = []  # each token's place in its topic (the attention's document mask)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            while len(self._inputs) < self.seq_len:
                tokens = self._tokenizer.encode(self._documents[self._next], add_bos=True, add_eos=True)
                self._inputs.extend(tokens[:-1])
                self._labels.extend(tokens[1:])
                self._positions.extend(range(len(tokens) - 1))
                self._next += 1
                if self._next == len(self._documents):
                    self._next, self._passes = 0, self._passes + 1
            inputs, labels = self._inputs[: self.seq_len], self._labels[: self.seq_len]
            positions = _from_zero(self._positions[: self.seq_len])
            del self._inputs[: self.seq_len], self._labels[: self.seq_len], self._positions[: self.seq_len]
            yield ({"input": torch.tensor(inputs, dtype=torch.long), "positions": torch.tensor(positions, dtype=torch.long)},
                   torch.tensor(labels, dtype=torch.long))

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next, "passes": self._passes, "inputs": list(self._inputs),
                "labels": list(self._labels), "positions": list(self._positions)}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._next, self._passes = int(state_dict["next"]), int(state_dict["passes"])
        self._inputs, self._labels = list(state_dict["inputs"]), list(state_dict["labels"])
        self._positions = list(state_dict["positions"])


def _from_zero(positions: list[int]) -> list[int]:
    """A window's positions, the topic it starts inside of counted from the window's start
    (torchtitan's data loaders do the same)."""
    offset = positions[0]
    if offset == 0:
        return positions
    cut = next((i for i, p in enumerate(positions) if p == 0), len(positions))
    return [p - offset for p in positions[:cut]] + positions[cut:]


class PydocTextDataLoader(ParallelAwareDataloader):
    """torchtitan's data loader over :class:`PydocTextDataset`: ``local_batch_size`` windows
    a batch, checkpointed by torchtitan's ``CheckpointManager`` like its own loaders."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "pydoc_topics"

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        dataset = PydocTextDataset(tokenizer, seq_len, dp_rank, dp_world_size)
        super().__init__(
            dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, num_workers=config.num_workers,
            batch_size=local_batch_size, snapshot_every_n_steps=snapshot_every_n_steps,
        )  # fmt: skip
