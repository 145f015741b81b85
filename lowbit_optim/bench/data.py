"""The benchmark's corpus: the standard library's own ``.py`` sources, as bytes.

Every Python install ships them, so the benchmark downloads nothing and any machine trains on
real text. The split is by file (every tenth file is held out), so validation text is code
the model never saw, not a neighbouring slice of the same file.
"""

import pathlib
import sysconfig
from dataclasses import dataclass

import torch

VOCAB_SIZE = 256  # byte-level: one token per byte
VALIDATION_EVERY = 10  # file i goes to validation when i % 10 == 9


def stdlib_source_files() -> list[pathlib.Path]:
    """The top-level ``.py`` files of this interpreter's standard library, sorted by name."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no .py files found in the standard library at {root}")
    return files


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    num_files: int

    def describe(self) -> dict:
        return {
            "source": "standard library .py files",
            "python_stdlib": sysconfig.get_paths()["stdlib"],
            "files": self.num_files,
            "train_bytes": self.train.numel(),
            "val_bytes": self.val.numel(),
        }


def load_corpus(max_bytes: int | None = None) -> Corpus:
    """Train/validation bytes from the stdlib sources (at most ``max_bytes`` in all)."""
    train_parts, val_parts = [], []
    total = 0
    files = stdlib_source_files()
    used = 0
    for index, path in enumerate(files):
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes and used >= VALIDATION_EVERY:
            break
        (val_parts if index % VALIDATION_EVERY == VALIDATION_EVERY - 1 else train_parts).append(data)
        total += len(data)
        used += 1
    if not val_parts:
        raise RuntimeError("the corpus is too small to hold out a validation file")

    def as_tensor(parts):
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

    return Corpus(train=as_tensor(train_parts), val=as_tensor(val_parts), num_files=used)


def batch_offsets(data: torch.Tensor, *, count: int, batch_size: int, context: int,
                  seed: int) -> torch.Tensor:
    """``(count, batch_size)`` random window starts, drawn up front from ``seed``: every
    optimizer sees exactly the same batches in the same order."""
    if data.numel() <= context + 1:
        raise ValueError(f"text of {data.numel()} bytes is too short for a context of {context}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, data.numel() - context - 1, (count, batch_size), generator=generator)


def get_batch(data: torch.Tensor, offsets: torch.Tensor, context: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, ``(batch, context)`` int64 each."""
    index = offsets[:, None] + torch.arange(context + 1)
    windows = data[index].long()
    windows = windows.to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]
