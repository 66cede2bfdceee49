"""The LinformerModel backbone, the sequence classifier, their base class and typed outputs."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import hub, manifest
from .attention import CausalState
from .checks import check_choice
from .config import LinformerConfig
from .dropout import Dropout
from .embeddings import (
    LinformerEmbeddings,
    LinformerPooler,
    causal_position_ids,
    init_weights,
    masked_mean,
)
from .encoder import LinformerEncoder
from .functional import gather_positions, real_first
from .input_checks import (
    check_device,
    check_index_range,
    check_key_padding_mask,
    check_seq_len,
    check_states,
    check_tensor,
    check_token_ids,
    check_token_type_ids,
)
from .losses import at_least_float32
from .memory import check_weights_fit
from .seq2seq_config import Seq2SeqConfig

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound="LinformerPreTrainedModel")
POOLINGS = ("cls", "mean", "last")


# `cls` on a causal model: its first token has attended to itself only, so the logits do
# not depend on the rest of the text (refused where a run asks for it, warned of where a
# model of an earlier version is loaded with it).
CAUSAL_CLS = (
    "pooling 'cls' takes the first real token, which a causal model lets attend to itself "
    "only: use 'last' (the last real token, which has seen the whole text) or 'mean'"
)


@dataclass
class LinformerOutput:
    """Backbone output: `last_hidden_state` (B, N, dim); `hidden_states` (depth + 1 of them)
    when `output_hidden_states=True`; `attentions` (B, H, N, M) per layer when
    `output_attentions=True`; `pooler_output` (B, dim) when the config has `pooler=True`."""

    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    pooler_output: Tensor | None = None


@dataclass
class SequenceClassifierOutput:
    """Classification output: `loss` (when labels were given), `logits` (B, num_labels)."""

    loss: Tensor | None
    logits: Tensor
    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


# Outputs are pytree nodes so that torch.export and torch.compile can trace models returning them.
for _output in (LinformerOutput, SequenceClassifierOutput):
    torch.export.register_dataclass(_output)


class LinformerPreTrainedModel(nn.Module):
    """Base of all models: holds the config; `save_pretrained` / `from_pretrained`."""

    base_model_prefix = "linformer"

    def __init__(self, config: LinformerConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def backbone(self) -> LinformerModel:
        """The LinformerModel inside (the model itself for the backbone)."""
        return getattr(self, self.base_model_prefix)

    def model_kwargs(self) -> dict[str, Any]:
        """Constructor arguments beyond the config, saved in config.json."""
        return {}

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Writes `config.json` and `model.safetensors` (shared tensors once) into `path`."""
        hub.save_pretrained(self, path, type(self).__name__, self.model_kwargs())

    @classmethod
    def from_pretrained(
        cls: type[ModelT],
        path: str | os.PathLike,
        *,
        config_overrides: dict[str, Any] | None = None,
        verify: bool = True,
        keep_head: bool = True,
        dtype: torch.dtype | str | None = None,
        **model_kwargs: Any,
    ) -> ModelT:
        """Loads a model saved by `save_pretrained` (or a training checkpoint), in eval mode
        (dropout off) as `transformers` returns it: call `train()` before training it.

        Loading a different architecture, or `keep_head=False`, keeps the backbone only (e.g. a
        classifier from a masked-LM checkpoint, or one of 5 classes from one of 2); the new
        head is freshly initialised, and the saved head's settings (e.g. a classifier's
        `pooling`) go with it: `model_kwargs` gives the new head's, the defaults the rest.

        Args:
            path: directory with config.json and model.safetensors.
            config_overrides: config fields to change (e.g. dropout, checkpointing).
            verify: check the files against the directory's manifest.json, when it has one
                (training checkpoints do); False loads files changed on purpose.
            keep_head: load the saved head too when the architecture is the same.
            dtype: the model's dtype: None, float32 (as `transformers`' default: a float64
                or bf16 file is cast); "auto", the file's; or a torch dtype.
            **model_kwargs: constructor arguments (e.g. num_labels) overriding the saved ones.

        Raises:
            FileNotFoundError: if a file is missing.
            ValueError: if a file is corrupt or the weights do not match the config, or
                for a dtype that is not a floating torch dtype or "auto";
                manifest.IntegrityError if a file does not match the manifest.
        """
        floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
        if not (floating or dtype in (None, "auto")):
            raise ValueError(f'dtype must be a floating torch dtype or "auto", got {dtype!r}')
        if not os.fspath(path):  # it read the working directory
            raise ValueError("path is empty (''); name a checkpoint folder")
        path = hub.pinned(path)
        manifest.check_before_load(path, verify)
        meta = hub.read_config(path)
        if meta["architecture"] not in _architectures():  # read as "another" one's backbone
            raise ValueError(
                f"{os.path.join(os.fspath(path), hub.CONFIG_NAME)}: architecture "
                f"{meta['architecture']!r} is none of this library's "
                f"({', '.join(sorted(_architectures()))})"
            )
        if meta["architecture"] != cls.__name__:
            hub.check_encoder(meta, path, f"load it with {meta['architecture']}.from_pretrained")
        config = meta["config"].replace(**(config_overrides or {}))
        same = meta["architecture"] == cls.__name__ and keep_head
        sides = [config.encoder, config.decoder] if isinstance(config, Seq2SeqConfig) else [config]
        try:  # sizes no machine here could hold: named with the file they came from
            for side in sides:
                check_weights_fit(side)
        except ValueError as err:
            raise ValueError(f"{os.path.join(os.fspath(path), hub.CONFIG_NAME)}: {err}") from None
        model = cls(config, **{**(meta["model_kwargs"] if same else {}), **model_kwargs})
        tensors = hub.read_weights(path)
        hub.warn_not_finite(tensors, path)
        if dtype is not None:
            model.to(hub.weights_dtype(tensors, path) if dtype == "auto" else dtype)
        if same:
            changed = {k: v for k, v in model_kwargs.items() if meta["model_kwargs"].get(k) != v}
            try:
                hub.load_weights(model, tensors, str(path))
            except ValueError as err:
                if not changed:
                    raise
                raise ValueError(
                    f"{err}\n{changed} differ from the saved {meta['model_kwargs']}: pass "
                    f"keep_head=False to load the backbone with a new head"
                ) from None
            return model.eval()
        if meta["architecture"] != LinformerModel.__name__:
            prefix = cls.base_model_prefix + "."
            tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        hub.load_weights(model.backbone, tensors, str(path))
        if model.backbone is not model:
            logger.info(
                "loaded the backbone of a %s; the %s head is newly initialised",
                meta["architecture"],
                cls.__name__,
            )
        return model.eval()


def _architectures() -> set[str]:
    """The names of the model classes (`LinformerPreTrainedModel` and its subclasses, a
    user's own included) a config.json may name."""
    names, classes = set(), [LinformerPreTrainedModel]
    while classes:
        model_class = classes.pop()
        names.add(model_class.__name__)
        classes += model_class.__subclasses__()
    return names


class LinformerModel(LinformerPreTrainedModel):
    """Embeddings + encoder: the backbone every task model wraps.

    Args:
        config: the architecture; `proj_dim=None` gives the exact-attention Transformer.
        pooled: whether `pooler_output` is made (with `config.pooler`). A task model's
            backbone passes False: its pooler (a converted BERT's) is kept, to load and save,
            but frozen and not run; trainable and unused, DistributedDataParallel would wait
            for its gradients and stop at the second step.
    """

    def __init__(self, config: LinformerConfig, *, pooled: bool = True) -> None:
        super().__init__(config)
        check_weights_fit(config)
        self.embeddings = LinformerEmbeddings(config)
        self.encoder = LinformerEncoder(config)
        self.pooler = LinformerPooler(config.dim) if config.pooler else None
        self.apply(lambda m: init_weights(m, config.init_std))
        self.pooled = pooled
        if self.pooler is not None and not pooled:
            self.pooler.requires_grad_(False)

    @property
    def backbone(self) -> LinformerModel:
        return self

    def forward(
        self,
        input_ids: Tensor,
        key_padding_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        states: list[CausalState] | None = None,
    ) -> LinformerOutput:
        """Encodes a batch of token ids of any length up to max_seq_len.

        Padding may be anywhere: the real tokens are numbered 0, 1, ... (and an encoder
        projects them with E's first rows), so left or inner padding changes no real output,
        as right padding changes none.

        Args:
            input_ids: (B, N) int64.
            key_padding_mask: optional bool (B, N), True at real tokens.
            token_type_ids: optional (B, N) segment ids (needs type_vocab_size > 0).
            output_hidden_states: also return the embeddings and every layer's output.
            output_attentions: also return every layer's attention matrix.
            states: causal generation: one `CausalState` per layer; `input_ids` are the
                positions that follow them (the states are updated in place).

        Raises:
            ValueError: if N exceeds max_seq_len or the inputs are malformed.
        """
        check_token_ids(input_ids)
        check_states(states, self.config.depth, CausalState)
        start = states[0].length if states else 0
        check_seq_len(start + input_ids.shape[1], self.config.max_seq_len)
        if input_ids.shape[1] < 1:  # a generation step of no token
            raise ValueError("input_ids holds no token (seq_len 0)")
        check_key_padding_mask(key_padding_mask, *input_ids.shape)  # before anything reads it
        check_device(input_ids, self.embeddings.tokens.weight)
        check_token_type_ids(token_type_ids, input_ids)
        position_ids = (
            causal_position_ids(input_ids, key_padding_mask, start) if self.config.causal else None
        )
        order = None
        if key_padding_mask is not None and not self.config.causal:  # causal: per layer
            order = real_first(key_padding_mask)  # the encoder sees right padding only
            input_ids, key_padding_mask = (
                input_ids.gather(1, order),
                key_padding_mask.gather(1, order),
            )
            if token_type_ids is not None:
                token_type_ids = token_type_ids.gather(1, order)
        x = self.embeddings(input_ids, token_type_ids, position_ids)
        last, hidden, attentions = self.encoder(
            x, key_padding_mask, output_hidden_states, output_attentions, states,
            right_padded=order is not None,
        )  # fmt: skip
        pooled = self.pooler(last) if self.pooler is not None and self.pooled else None
        if order is not None:
            last, hidden, attentions = self._restore_positions(order, last, hidden, attentions)
        return LinformerOutput(last, hidden, attentions, pooled)

    def _restore_positions(
        self,
        order: Tensor,
        last: Tensor,
        hidden: tuple[Tensor, ...] | None,
        attentions: tuple[Tensor, ...] | None,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
        """The outputs of the inputs gathered by `order` put back at the inputs' positions:
        the rows of the hidden states and attention matrices, and an exact layer's columns."""
        back = order.argsort(1)
        last = gather_positions(last, back)
        if hidden is not None:
            hidden = tuple(gather_positions(h, back) for h in hidden)
        if attentions is not None:
            attentions = tuple(
                gather_positions(weights, back, 2)
                if proj_dim is not None
                else gather_positions(gather_positions(weights, back, 2), back, 3)
                for weights, proj_dim in zip(attentions, self.config.proj_dims, strict=True)
            )
        return last, hidden, attentions


class LinformerForSequenceClassification(LinformerPreTrainedModel):
    """Backbone + pooled classifier (dense, tanh, linear). `num_labels=1` is regression (MSE).

    Args:
        config: the architecture.
        num_labels: number of classes (1 for regression).
        pooling: `cls` (the first real token; an encoder's default), `last` (the last real
            token; a causal model's default, as `transformers`' GPT-2 classifier) or `mean`
            (over real tokens only).
    """

    def __init__(
        self, config: LinformerConfig, num_labels: int = 2, pooling: str | None = None
    ) -> None:
        super().__init__(config)
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels must be an integer >= 1, got {num_labels!r}")
        check_weights_fit(config, num_labels)
        if pooling is None:
            pooling = "last" if config.causal else "cls"
        check_choice("pooling", pooling, POOLINGS)
        if config.causal and pooling == "cls":
            warnings.warn(CAUSAL_CLS, stacklevel=2)
        self.num_labels, self.pooling = num_labels, pooling
        self.linformer = LinformerModel(config, pooled=False)
        self.head = nn.Sequential(
            Dropout(config.dropout),
            nn.Linear(config.dim, config.dim),
            nn.Tanh(),
            Dropout(config.dropout),
            nn.Linear(config.dim, num_labels),
        )
        self.head.apply(lambda m: init_weights(m, config.init_std))

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_labels": self.num_labels, "pooling": self.pooling}

    def pool(self, hidden: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """(B, N, dim) -> (B, dim): the first or last real token, or the mean over real
        tokens."""
        if self.pooling == "mean":
            return masked_mean(hidden, key_padding_mask)
        last = self.pooling == "last"
        if key_padding_mask is None:
            return hidden[:, -1 if last else 0]
        real = key_padding_mask.to(torch.uint8)
        if last:  # N - 1 under left padding
            index = real.shape[1] - 1 - real.flip(1).argmax(1)
        else:  # 0 under right padding
            index = real.argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]

    def forward(
        self,
        input_ids: Tensor,
        key_padding_mask: Tensor | None = None,
        labels: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> SequenceClassifierOutput:
        """Class logits (B, num_labels) and, given labels (B,), the loss."""
        if labels is not None:
            check_tensor("labels", labels, "of class ids (or regression targets)")
        out = self.linformer(
            input_ids, key_padding_mask, token_type_ids, output_hidden_states, output_attentions
        )
        logits = self.head(self.pool(out.last_hidden_state, key_padding_mask))
        loss = None
        if labels is not None:
            batch = logits.shape[0]
            if labels.shape not in ((batch,), (batch, 1)):  # (B, 1) as the logits, as in HF
                raise ValueError(
                    f"labels must have shape (batch,) = ({batch},) (or ({batch}, 1)), got "
                    f"{tuple(labels.shape)}"
                )
            labels = labels.reshape(batch)
            if self.num_labels == 1:
                logits32 = at_least_float32(logits.squeeze(-1))
                loss = F.mse_loss(logits32, labels.to(logits32.dtype))
            else:
                check_index_range(labels, self.num_labels, "labels", -100)
                loss = F.cross_entropy(at_least_float32(logits), labels.long())
        return SequenceClassifierOutput(
            loss, logits, out.last_hidden_state, out.hidden_states, out.attentions
        )
