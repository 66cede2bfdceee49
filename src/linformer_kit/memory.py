"""Sizes this machine could never hold, refused by name before anything is allocated: a
`--dim` or `--depth` of 10**12 failed in the allocator with a traceback (or a bare
MemoryError), and a `--batch-size` of 10**12 grew the process for minutes before the kill."""

from __future__ import annotations

import os

import torch

from .config import LinformerConfig


def memory_bytes(device: torch.device) -> int | None:
    """The memory of `device`: a GPU's, or the machine's RAM (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows) or no such name
        return None


def check_fits(need: int, what: str, device: torch.device | None = None) -> None:
    """Raises ValueError when `need` bytes, a lower bound of what `what` takes, exceed the
    memory of `device` (default the CPU's).

    Args:
        need: bytes that cannot be done without (e.g. the weights alone, in float32).
        what: the thing and the settings that size it, as the refusal names them.
        device: where it would be held.
    """
    device = device or torch.device("cpu")
    have = memory_bytes(device)
    if have is not None and need > have:
        where = "GPU memory" if device.type == "cuda" else "memory"
        raise ValueError(
            f"{what} takes at least {need / 2**30:,.1f} GiB: more than this machine's "
            f"{where} ({have / 2**30:,.1f} GiB); make it smaller"
        )


def check_batch_fits(batch_size: int) -> None:
    """Raises ValueError for a batch of `batch_size` sequences whose token ids alone (8 bytes
    each, one token a sequence at least) this machine's memory could never hold."""
    what = f"a batch of batch_size {batch_size} (an 8-byte token id per sequence)"
    check_fits(8 * batch_size, what)


def check_weights_fit(config: LinformerConfig, num_labels: int = 0) -> None:
    """Raises ValueError, naming the sizes, for a model whose weights the memory of the device
    it is built on (torch's default: the CPU, a GPU; none for "meta") could never hold: the
    embeddings', every layer's attention and feed-forward maps' and a classifier's head of
    `num_labels` (a lower bound: biases, norms and projections left out), in torch's default
    dtype.
    """
    device = torch.get_default_device()
    if device.type == "meta":  # shapes alone, no memory
        return
    c = config
    weights = (c.vocab_size + c.max_seq_len + c.type_vocab_size + num_labels) * c.dim
    weights += c.depth * (4 * c.dim + 2 * c.hidden_ffn_dim) * c.dim
    labels = f", num_labels {num_labels}" if num_labels else ""
    check_fits(
        torch.get_default_dtype().itemsize * weights,
        f"a model of vocab_size {c.vocab_size}, max_seq_len {c.max_seq_len}, type_vocab_size "
        f"{c.type_vocab_size}, dim {c.dim}, depth {c.depth}, ffn_dim {c.hidden_ffn_dim}{labels} "
        f"({weights:,} weights or more)",
        device,
    )
