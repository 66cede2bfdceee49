"""`spectrum_report`: a checkpoint and some text in, the spectrum JSON and Figure 1 PNG out."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch import Tensor

from ..files import atomic_write, check_output_path
from .inputs import (
    check_one_matrix,
    checkpoint_tokenizer,
    load_backbone,
    random_windows,
    token_windows,
)
from .plots import plot_spectrum
from .spectrum import attention_spectra, summarize

RESULT_NAME = "spectrum.json"
PLOT_NAME = "spectrum.png"


@dataclass(kw_only=True)
class SpectrumSettings:
    """Settings of `spectrum_report` (also the `linformer spectrum` flags)."""

    data: str = field(
        default="stdlib",
        metadata={"help": "held-out text: a file, directory, JSONL file or 'stdlib'"},
    )
    glob: str = field(default="**/*.txt", metadata={"help": "files to read inside a directory"})
    text_field: str = field(
        default="text", metadata={"help": "JSONL field or CSV column holding the text"}
    )
    random_tokens: bool = field(
        default=False, metadata={"help": "random token ids instead of --data (no tokenizer)"}
    )
    num_samples: int = field(default=16, metadata={"help": "sequences to average over"})
    seq_len: int = field(default=0, metadata={"help": "tokens per sequence (0 = max_seq_len)"})
    batch_size: int = field(default=4, metadata={"help": "sequences per forward pass"})
    masses: list[float] = field(
        default_factory=lambda: [0.9, 0.95, 0.99],
        metadata={"help": "spectral-mass fractions to find k for"},
    )
    index: int = field(
        default=0,
        metadata={"help": "k at which the heatmap reads the curves (0 = the recommended k)"},
    )
    seed: int = field(default=0, metadata={"help": "seed of --random-tokens"})
    out: str = field(default="spectrum", metadata={"help": "output directory"})

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.masses or not all(0 < m <= 1 for m in self.masses):
            raise ValueError(f"masses must be fractions in (0, 1], got {self.masses}")
        if self.seq_len < 0 or self.index < 0:
            raise ValueError(f"seq_len and index must be >= 0, got {self.seq_len}, {self.index}")
        check_output_path(self.out, directory=True)  # before the model runs


def sequences(
    path: str | os.PathLike, settings: SpectrumSettings, *, vocab_size: int, seq_len: int
) -> tuple[Tensor, Tensor]:
    """The sequences to analyse: windows of `settings.data` tokenised with the checkpoint's
    tokenizer.json, or random ids with `random_tokens`. (B, seq_len) ids and bool mask.

    Raises:
        FileNotFoundError: if the checkpoint has no tokenizer.json and `random_tokens` is off.
    """
    if settings.random_tokens:
        return random_windows(
            vocab_size, count=settings.num_samples, seq_len=seq_len, seed=settings.seed
        )
    tokenizer = checkpoint_tokenizer(path, vocab_size)
    if tokenizer is None:
        raise FileNotFoundError(
            f"no tokenizer.json in {path}: pass --random-tokens to use random token ids"
        )
    return token_windows(
        tokenizer,
        settings.data,
        count=settings.num_samples,
        seq_len=seq_len,
        glob=settings.glob,
        text_field=settings.text_field,
    )


def spectrum_report(path: str | os.PathLike, settings: SpectrumSettings) -> dict:
    """Measures the attention spectrum of a checkpoint; writes spectrum.json and spectrum.png.

    Args:
        path: checkpoint directory (config.json + model.safetensors, and tokenizer.json
            unless `random_tokens`).
        settings: data, sample size and output directory.

    Returns:
        The report written to JSON (see `spectrum.summarize`), plus the checkpoint and settings.

    Raises:
        FileNotFoundError: if the checkpoint or data is missing, or it has no tokenizer.json
            and `random_tokens` is off.
        ValueError: if seq_len exceeds the model's max_seq_len, index exceeds seq_len, or the
            data holds no tokens.
    """
    model = load_backbone(path)
    config = model.config
    check_one_matrix(config, list(range(config.depth)), path)
    seq_len = settings.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {config.max_seq_len}")
    if settings.index > seq_len:  # no curve is longer (10**12 failed in the allocator)
        raise ValueError(f"index must be in [0, seq_len={seq_len}], got {settings.index}")
    ids, mask = sequences(path, settings, vocab_size=config.vocab_size, seq_len=seq_len)
    batches = list(zip(ids.split(settings.batch_size), mask.split(settings.batch_size)))
    spectra = attention_spectra(model, batches, total=len(batches))
    report = {
        "checkpoint": os.fspath(path),
        "attention": "exact" if config.is_exact else f"linformer (proj_dim={config.proj_dim})",
        **summarize(spectra, settings.masses, settings.index or None),
        "settings": asdict(settings),
    }
    out = Path(settings.out)
    # the figure first (the slow write): an interrupt leaves the last run's pair, not a new
    # JSON beside the last run's figure
    plot_spectrum(report, out / PLOT_NAME, title=f"{os.fspath(path)} ({report['attention']})")
    atomic_write(out / RESULT_NAME, lambda tmp: Path(tmp).write_text(json.dumps(report) + "\n"))
    return report
