"""What the analysis tools run on: a checkpoint's backbone, its tokenizer, token sequences.

`token_windows` is the one place that turns a data argument into model input, so the tools
follow whatever corpora the data package reads (text, JSONL, directories, the stdlib).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from ..config import LinformerConfig
from ..data.corpus import iter_documents
from ..data.tokenizer import TOKENIZER_NAME, TextTokenizer, load_tokenizer
from ..models import LinformerModel

logger = logging.getLogger(__name__)


def load_backbone(path: str | os.PathLike) -> LinformerModel:
    """The LinformerModel of a checkpoint directory (the backbone of a masked-LM or
    classifier checkpoint), in eval mode."""
    return LinformerModel.from_pretrained(path)


def check_one_matrix(config: LinformerConfig, layers: list[int], path: str | os.PathLike) -> None:
    """Raises ValueError if one of `layers` of a causal model is a Linformer layer, whose
    attention has no single (n, M) matrix to analyse: per block, its own keys exactly and
    the earlier blocks through k summary rows."""
    projected = [i for i in layers if 0 <= i < config.depth and config.proj_dims[i] is not None]
    if config.causal and projected:
        raise ValueError(
            f"{path} is a causal Linformer (layers {projected}): its attention is per block "
            f"(the block's own keys, the earlier blocks through k summary rows), not one "
            f"matrix; the analysis tools read encoders and exact causal models"
        )


def checkpoint_tokenizer(path: str | os.PathLike, vocab_size: int) -> TextTokenizer | None:
    """The `tokenizer.json` saved beside a checkpoint (its own truncation and padding off, as
    for every loaded tokenizer), or None when there is none.

    Raises:
        ValueError: if it has more tokens than the model's `vocab_size`.
    """
    if not (Path(path) / TOKENIZER_NAME).is_file():
        return None
    return load_tokenizer(path, model_vocab_size=vocab_size)


def token_windows(
    tokenizer: TextTokenizer,
    data: str,
    *,
    count: int,
    seq_len: int,
    glob: str = "**/*.txt",
    text_field: str = "text",
) -> tuple[Tensor, Tensor]:
    """Up to `count` windows of `seq_len` tokens cut from the documents of `data`.

    Documents are read in order and joined with the separator token, as pretraining packs
    them. When the data runs out before `count` full windows, the leftover tail becomes one
    last window, right-padded and masked, if it is the only one or at least half a window.

    Args:
        tokenizer: the checkpoint's tokenizer.
        data: a file, directory, JSONL file or `stdlib` (see `data.iter_documents`).
        count: windows wanted.
        seq_len: tokens per window.
        glob: files to read inside a directory.
        text_field: the JSONL field holding the text.

    Returns:
        input_ids (B, seq_len) int64 and key_padding_mask (B, seq_len) bool, B <= count.

    Raises:
        ValueError: if the data holds no tokens.
    """
    windows: list[list[int]] = []
    stream: list[int] = []
    for document in iter_documents([data], glob=glob, text_field=text_field):
        stream += tokenizer.encode_batch([document.text])[0] + [tokenizer.sep_id]
        while len(stream) >= seq_len and len(windows) < count:
            windows.append(stream[:seq_len])
            stream = stream[seq_len:]
        if len(windows) == count:
            break
    lengths = [seq_len] * len(windows)
    # a tail under half a window beside full ones is left out: averaged in with the weight of
    # a full window, a lone separator (a 1 x 1 map, all its mass in one value) halved the
    # measured k
    if len(windows) < count and stream and (not windows or 2 * len(stream) >= seq_len):
        lengths.append(len(stream))
        windows.append(stream + [tokenizer.pad_id] * (seq_len - len(stream)))
    elif len(windows) < count and stream:
        logger.info("left out the data's last %d tokens (under half a window)", len(stream))
    if not windows:
        raise ValueError(f"{data}: no tokens to analyse")
    if len(windows) < count:
        logger.warning(
            "%s holds %d windows of %d tokens, not %d", data, len(windows), seq_len, count
        )
    mask = torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)
    return torch.tensor(windows), mask


def random_windows(
    vocab_size: int, *, count: int, seq_len: int, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """`count` sequences of uniformly random token ids, for models without a tokenizer.

    Returns:
        input_ids (count, seq_len) int64 and an all-True key_padding_mask.
    """
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (count, seq_len), generator=generator)
    return ids, torch.ones(count, seq_len, dtype=torch.bool)


def encode_text(tokenizer: TextTokenizer, text: str, max_seq_len: int) -> tuple[Tensor, list[str]]:
    """Token ids (1, N) of one text, with the tokenizer's own special tokens (BERT's [CLS] and
    [SEP]), cut to `max_seq_len`; and a readable label per token.

    Raises:
        ValueError: if the text yields no token, or is not Unicode text.
    """
    if not tokenizer.encode_batch([text])[0]:  # [CLS] [SEP] alone; names text that is not text
        raise ValueError(f"the text {text[:40]!r} yields no tokens")
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=True).ids
    if len(ids) > max_seq_len:
        logger.warning("the text has %d tokens; keeping the first %d", len(ids), max_seq_len)
        ids = ids[:max_seq_len]
    labels = [token_label(tokenizer, i) for i in ids]
    return torch.tensor([ids]), labels


def token_label(tokenizer: TextTokenizer, token_id: int) -> str:
    """A token as text for an axis label, whitespace made visible."""
    text = tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)
    text = text or tokenizer.tokenizer.id_to_token(token_id) or f"#{token_id}"
    return text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u00b7")
