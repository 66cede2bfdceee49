"""LinformerConfig: every architectural choice of a model, validated, serialisable to JSON."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .checks import (
    check_choice,
    check_finite_positive,
    check_non_negative,
    check_positive,
    check_probability,
)

SHARINGS = ("none", "headwise", "kv", "layerwise")
PROJECTIONS = ("linear", "conv", "pool", "random", "adaptive")
CAUSAL_PROJECTIONS = ("linear", "random")  # row j of E touches position j only
ACTIVATIONS = ("gelu", "relu")
POSITIONS = ("learned", "sinusoidal")
CHECKPOINTINGS = ("none", "layer", "attention")
# What a classifier keeps of a text longer than max_seq_len (`data.classification.cut_tokens`).
TRUNCATIONS = ("head", "tail", "head+tail")
# Set by fine-tuning (from the data, or finetune's own flag), never by a model flag.
FINETUNE_FIELDS = ("id2label", "label2id", "truncation")


def check_proj_dim(proj_dim: Any, max_seq_len: int, projection: str = "linear") -> None:
    """Raises ValueError unless `proj_dim` (k) is an integer in [1, max_seq_len], dividing
    max_seq_len for the `conv` and `pool` projections."""
    if (
        not isinstance(proj_dim, int)
        or isinstance(proj_dim, bool)
        or not 1 <= proj_dim <= max_seq_len
    ):
        raise ValueError(
            f"proj_dim must be an integer in [1, max_seq_len={max_seq_len}], got {proj_dim!r}"
        )
    if projection in ("conv", "pool") and max_seq_len % proj_dim:
        raise ValueError(
            f"projection={projection!r} uses kernel = stride = max_seq_len / proj_dim, so "
            f"proj_dim ({proj_dim}) must divide max_seq_len ({max_seq_len})"
        )


ConfigT = TypeVar("ConfigT", bound="ConfigDict")


class ConfigDict:
    """`replace`, `to_dict` and `from_dict` of a config dataclass (LinformerConfig,
    Seq2SeqConfig)."""

    def replace(self: ConfigT, **changes: Any) -> ConfigT:
        """Returns a validated copy with the given fields changed.

        Raises:
            ValueError: for a name that is not a config field, or a bad value.
        """
        check_fields(type(self), changes)  # a TypeError from dataclasses named no field list
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form of the config."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[ConfigT], data: dict[str, Any]) -> ConfigT:
        """Builds a config from `to_dict` output.

        Raises:
            ValueError: if the dict holds a key that is not a config field.
        """
        check_fields(cls, data)
        return cls(**data)


@dataclass(kw_only=True)
class LinformerConfig(ConfigDict):
    """Architecture of a Linformer encoder; `proj_dim=None` gives the exact-attention Transformer.

    Raises:
        ValueError: on construction, naming the bad field, its value and the allowed range.
    """

    vocab_size: int = field(default=30522, metadata={"help": "token vocabulary size"})
    max_seq_len: int = field(
        default=512,
        metadata={"help": "longest n the model accepts: the sequence projection's input size"},
    )
    dim: int = field(default=256, metadata={"help": "model width"})
    depth: int = field(default=4, metadata={"help": "number of encoder layers"})
    num_heads: int = field(
        default=4, metadata={"help": "attention heads per layer; must divide dim"}
    )
    ffn_dim: int | None = field(
        default=None, metadata={"help": "feed-forward hidden width; none means 4 * dim"}
    )
    proj_dim: int | list[int] | None = field(
        default=128,
        metadata={
            "help": "the paper's k (keys/values projected to k rows), or one k per layer "
            "(K1,K2,...); none = exact attention, a plain Transformer"
        },
    )
    projection: str = field(
        default="linear",
        metadata={"help": "sequence projection kind: linear, conv, pool, random or adaptive"},
    )
    sharing: str = field(
        default="layerwise",
        metadata={"help": "projection sharing (paper sec. 4): none, headwise, kv, layerwise"},
    )
    activation: str = field(
        default="gelu", metadata={"help": "feed-forward non-linearity: gelu or relu"}
    )
    norm_first: bool = field(
        default=True, metadata={"help": "pre-LN (true) or post-LN as in BERT/RoBERTa (false)"}
    )
    position: str = field(
        default="learned", metadata={"help": "position embeddings: learned or sinusoidal"}
    )
    type_vocab_size: int = field(
        default=0, metadata={"help": "token-type (segment) embeddings; 0 disables them"}
    )
    pooler: bool = field(
        default=False,
        metadata={"help": "BERT pooler (dense + tanh on the first token) -> pooler_output"},
    )
    pad_token_id: int = field(
        default=0,
        metadata={
            "help": "id of the padding token: what the data pads with and generate() fills "
            "finished rows with; padding is masked by key_padding_mask, never found by id"
        },
    )
    dropout: float = field(
        default=0.1, metadata={"help": "dropout on embeddings and on each sub-layer's output"}
    )
    attention_dropout: float = field(
        default=0.1, metadata={"help": "dropout on the attention weights (once, in the kernel)"}
    )
    layer_norm_eps: float = field(default=1e-5, metadata={"help": "epsilon of every LayerNorm"})
    init_std: float = field(
        default=0.02, metadata={"help": "std of the normal init of embeddings and dense weights"}
    )
    checkpointing: str = field(
        default="none", metadata={"help": "activation checkpointing: none, layer or attention"}
    )
    id2label: dict[int, str] | None = field(
        default=None, metadata={"help": "class names of a classifier trained on names"}
    )
    label2id: dict[str, int] | None = field(
        default=None, metadata={"help": "their ids: the inverse of id2label (as in HF)"}
    )
    truncation: str | None = field(
        default=None,
        metadata={
            "help": "what a classifier keeps of a text longer than max_seq_len: head (its "
            "start), tail (its end) or head+tail (a quarter from the start, the rest from "
            "the end); set by fine-tuning; none (a model fine-tuned before the setting "
            "existed) reads as head"
        },
    )
    causal: bool = field(
        default=False,
        metadata={"help": "autoregressive attention: position i sees positions <= i only"},
    )
    block_size: int = field(
        default=64,
        metadata={"help": "causal Linformer: window attended exactly; earlier blocks via k rows"},
    )

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "dim", "depth", "num_heads"):
            check_positive(name, getattr(self, name))
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.ffn_dim is not None:
            check_positive("ffn_dim", self.ffn_dim)
        check_choice("projection", self.projection, PROJECTIONS)
        check_choice("sharing", self.sharing, SHARINGS)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("position", self.position, POSITIONS)
        check_choice("checkpointing", self.checkpointing, CHECKPOINTINGS)
        if self.truncation is not None:
            check_choice("truncation", self.truncation, TRUNCATIONS)
        check_probability("dropout", self.dropout)
        check_probability("attention_dropout", self.attention_dropout)
        check_non_negative("type_vocab_size", self.type_vocab_size)
        for name in ("pooler", "norm_first"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        pad = self.pad_token_id
        if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < self.vocab_size:
            raise ValueError(
                f"pad_token_id must be an integer in [0, {self.vocab_size}), got {pad!r}"
            )
        for name in ("layer_norm_eps", "init_std"):
            check_finite_positive(name, getattr(self, name))
        self._check_proj_dim()
        self._check_label_names()
        self._check_causal()

    def _check_proj_dim(self) -> None:
        if self.proj_dim is None:
            return
        if isinstance(self.proj_dim, (list, tuple)):
            self.proj_dim = list(self.proj_dim)
            if len(self.proj_dim) != self.depth:
                raise ValueError(
                    f"proj_dim as a list needs one k per layer: got {len(self.proj_dim)} "
                    f"values for depth {self.depth}"
                )
            if self.sharing == "layerwise" and len(set(self.proj_dim)) > 1:
                raise ValueError(
                    f"sharing='layerwise' uses one projection for every layer, so it cannot "
                    f"have a different k per layer (proj_dim={self.proj_dim}); use a single "
                    f"int or sharing in none, headwise, kv"
                )
        for k in self.proj_dim if isinstance(self.proj_dim, list) else [self.proj_dim]:
            check_proj_dim(k, self.max_seq_len, self.projection)

    def _check_causal(self) -> None:
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")
        if self.causal and self.pooler:  # a warning: configs of earlier versions load
            warnings.warn(
                "pooler=True (BERT's pooler, on the first position) with causal=True: a "
                "causal model's first token attends to itself only, and under left padding "
                "the first position is a pad, so pooler_output says nothing of the text; set "
                "pooler=False (a classifier pools the last real token)",
                stacklevel=4,
            )
        check_positive("block_size", self.block_size)
        if self.causal and self.proj_dim is not None and self.block_size >= self.max_seq_len:
            warnings.warn(
                f"block_size ({self.block_size}) >= max_seq_len ({self.max_seq_len}): every "
                f"position is attended exactly, so this causal Linformer is exact causal "
                f"attention and its projections go unused; a block_size below max_seq_len "
                f"makes it a Linformer",
                stacklevel=4,
            )
        if self.causal and self.proj_dim is not None and self.projection not in CAUSAL_PROJECTIONS:
            raise ValueError(
                f"causal=True cannot use projection={self.projection!r}: it summarises "
                f"windows of positions, and a window still open at a "
                f"query's block would mix in positions after the query; use one of "
                f"{', '.join(CAUSAL_PROJECTIONS)} (row j of E touches position j only)"
            )

    def _check_label_names(self) -> None:
        if self.id2label is None and self.label2id is None:
            return
        names = self.id2label if self.id2label is not None else self.label2id
        if not isinstance(names, dict) or not names:
            raise ValueError(f"id2label and label2id must be non-empty dicts, got {names!r}")
        if self.id2label is None:
            self.id2label = {i: name for name, i in self.label2id.items()}
        try:
            # config.json stores the ids as strings: JSON object keys always are.
            self.id2label = {int(i): str(name) for i, name in self.id2label.items()}
        except (TypeError, ValueError) as err:
            raise ValueError(f"id2label keys must be integer ids, got {self.id2label!r}") from err
        derived = {name: i for i, name in self.id2label.items()}
        if sorted(self.id2label) != list(range(len(derived))):  # fewer names: duplicates
            raise ValueError(
                f"id2label must map the ids 0..n-1 to distinct names, got {self.id2label!r}"
            )
        if self.label2id is not None and self.label2id != derived:
            raise ValueError(
                f"label2id {self.label2id!r} is not the inverse of id2label {self.id2label!r}"
            )
        self.label2id = derived

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.num_heads

    @property
    def hidden_ffn_dim(self) -> int:
        """Feed-forward hidden width (ffn_dim, or 4 * dim when unset)."""
        return self.ffn_dim if self.ffn_dim is not None else 4 * self.dim

    @property
    def proj_dims(self) -> list[int | None]:
        """The k of every layer (None for exact attention)."""
        if isinstance(self.proj_dim, list):
            return list(self.proj_dim)
        return [self.proj_dim] * self.depth

    @property
    def is_exact(self) -> bool:
        """Whether the model runs exact softmax attention (proj_dim=None)."""
        return self.proj_dim is None


def check_fields(cls: type, data: dict[str, Any]) -> None:
    """Raises a ValueError if `data` holds a key that is not a field of dataclass `cls`."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")


def proj_dim_schedule(first: int, last: int, depth: int, multiple_of: int = 1) -> list[int]:
    """A non-increasing per-layer k: geometric from `first` (layer 0) down to `last`.

    The paper's "nonuniform projected dimension": higher layers' attention has lower rank,
    so they can use a smaller k.

    Args:
        first: k of the first layer.
        last: k of the last layer; at most `first`.
        depth: number of layers.
        multiple_of: round every k down to a multiple of this, at most `last` (so a
            layer may get less than `last`, down to that multiple). A multiple does not
            divide max_seq_len: `conv` and `pool` projections need k to divide it.

    Returns:
        A list of `depth` ints, non-increasing, each in [multiple_of, first].

    Raises:
        ValueError: for an argument that is not an integer >= 1, or bounds that are not
            multiple_of <= last <= first.
    """
    for name, value in (("first", first), ("last", last), ("depth", depth)):
        check_positive(name, value)  # a str or None failed in a comparison, 2.5 gave floats
    check_positive("multiple_of", multiple_of)
    if not multiple_of <= last <= first:
        raise ValueError(
            f"need depth >= 1 and 1 <= multiple_of <= last <= first; got depth={depth}, "
            f"first={first}, last={last}, multiple_of={multiple_of}"
        )
    if depth == 1:
        return [first]
    ratio = (last / first) ** (1 / (depth - 1))
    dims = [first * ratio**i for i in range(depth)]
    return [max(multiple_of, math.floor(k / multiple_of + 1e-9) * multiple_of) for k in dims]


def linformer_tiny(**overrides: Any) -> LinformerConfig:
    """A small model for tests and CPU demos (2 layers, width 64)."""
    base = dict(vocab_size=1000, max_seq_len=256, dim=64, depth=2, num_heads=4, proj_dim=32)
    return LinformerConfig(**{**base, **overrides})


def linformer_small(**overrides: Any) -> LinformerConfig:
    """A 4-layer, width-256 model: the shape of the CPU benchmarks."""
    base = dict(max_seq_len=4096, dim=256, depth=4, num_heads=4, proj_dim=256)
    return LinformerConfig(**{**base, **overrides})


def linformer_base(**overrides: Any) -> LinformerConfig:
    """RoBERTa-base shape (12 layers, 12 heads, width 768, 512 positions), k=256 as in the paper."""
    base = dict(
        vocab_size=50265,
        max_seq_len=512,
        dim=768,
        depth=12,
        num_heads=12,
        proj_dim=256,
        norm_first=False,
        pad_token_id=1,
    )
    return LinformerConfig(**{**base, **overrides})
