"""Seq2SeqConfig: the architecture of an encoder-decoder Linformer, serialisable to JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import ConfigDict, LinformerConfig


@dataclass(kw_only=True)
class Seq2SeqConfig(ConfigDict):
    """Architecture of an encoder-decoder Linformer: two LinformerConfigs and how they meet.

    Each side's `proj_dim` governs the attention over that side's sequence: the encoder's
    k (its last layer's, with its projection kind and sharing) projects the memory for the
    decoder's cross-attention too, the decoder's k its causal self-attention. So
    `proj_dim=None` in `encoder` makes the encoder and cross-attention exact, in `decoder`
    the decoder's self-attention; both give the exact encoder-decoder Transformer.

    Raises:
        ValueError: on construction, naming the bad field, its value and the allowed range.
    """

    encoder: LinformerConfig = field(
        default_factory=LinformerConfig,
        metadata={"help": "the encoder (bidirectional); max_seq_len is the longest source n"},
    )
    decoder: LinformerConfig = field(
        default_factory=lambda: LinformerConfig(causal=True),
        metadata={"help": "the decoder (causal=True); max_seq_len is the longest target m"},
    )
    share_embeddings: bool = field(
        default=False,
        metadata={"help": "one token embedding for both sides (needs one vocabulary)"},
    )
    decoder_start_token_id: int = field(
        default=0, metadata={"help": "the token every decoder input starts with"}
    )
    eos_token_id: int = field(default=2, metadata={"help": "the token that ends a target"})

    def __post_init__(self) -> None:
        for side in ("encoder", "decoder"):
            if isinstance(getattr(self, side), dict):  # from JSON
                setattr(self, side, LinformerConfig.from_dict(getattr(self, side)))
            elif not isinstance(getattr(self, side), LinformerConfig):
                raise TypeError(
                    f"{side} must be a LinformerConfig (or its dict), got "
                    f"{type(getattr(self, side)).__name__}"
                )
        if self.encoder.causal or not self.decoder.causal:
            raise ValueError(
                f"a seq2seq model needs encoder.causal=False and decoder.causal=True; got "
                f"{self.encoder.causal} and {self.decoder.causal}"
            )
        if self.encoder.dim != self.decoder.dim:
            raise ValueError(
                f"encoder.dim ({self.encoder.dim}) and decoder.dim ({self.decoder.dim}) must "
                f"be equal: cross-attention reads the memory at the decoder's width"
            )
        if not isinstance(self.share_embeddings, bool):
            raise ValueError(
                f"share_embeddings must be True or False, got {self.share_embeddings!r}"
            )
        if self.share_embeddings and self.encoder.vocab_size != self.decoder.vocab_size:
            raise ValueError(
                f"share_embeddings needs one vocabulary, got encoder.vocab_size "
                f"{self.encoder.vocab_size} and decoder.vocab_size {self.decoder.vocab_size}"
            )
        for name in ("decoder_start_token_id", "eos_token_id"):
            value = getattr(self, name)
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value < self.decoder.vocab_size
            ):
                raise ValueError(
                    f"{name} must be in [0, decoder.vocab_size={self.decoder.vocab_size}), "
                    f"got {value!r}"
                )

    @property
    def cross_attention(self) -> LinformerConfig:
        """The config whose sharing plan gives the decoder's cross-attention projections:
        the encoder's projection (memory length, kind, sharing, last layer's k) over the
        decoder's layers and heads."""
        return self.encoder.replace(
            depth=self.decoder.depth,
            num_heads=self.decoder.num_heads,
            proj_dim=self.encoder.proj_dims[-1],
        )

    @property
    def is_exact(self) -> bool:
        """Whether every attention is exact (proj_dim=None on both sides)."""
        return self.encoder.is_exact and self.decoder.is_exact


def config_from_dict(data: dict[str, Any]) -> LinformerConfig | Seq2SeqConfig:
    """A saved config of either kind: a Seq2SeqConfig has an `encoder` and a `decoder`."""
    if "encoder" in data:
        return Seq2SeqConfig.from_dict(data)
    return LinformerConfig.from_dict(data)
