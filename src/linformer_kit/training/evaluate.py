"""Evaluate a saved model: masked- or next-token perplexity on text, or a classifier's
accuracy / F1."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .. import hub
from ..causal_lm import LinformerForCausalLM
from ..checks import check_fraction
from ..config import LinformerConfig
from ..data.cache import PackedBlocks, token_dtype
from ..data.classification import ClassificationData, load_classification
from ..data.corpus import is_csv, is_jsonl, iter_csv, iter_documents, iter_jsonl
from ..data.tokenizer import TextTokenizer, load_tokenizer
from ..masked_lm import LinformerForMaskedLM
from ..models import LinformerForSequenceClassification
from .batches import ClassificationEvaluator, LMBatches, LMEvaluator, RowSchedule
from .distributed import resolve_device
from .settings import RUN_CONFIG_NAME, check_threads, use_threads

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EvaluateSettings:
    """What to evaluate a checkpoint on."""

    data: list[str] = field(
        default_factory=list,
        metadata={"help": "text files / directories, or labelled JSONL", "required": True},
    )
    batch_size: int = field(default=8, metadata={"help": "sequences per batch"})
    glob: str = field(default="**/*.txt", metadata={"help": "files to read inside directories"})
    text_field: str = field(
        default="text", metadata={"help": "JSONL field or CSV column of the text"}
    )
    label_field: str = field(
        default="label", metadata={"help": "JSONL field or CSV column of the label"}
    )
    mlm_probability: float | None = field(
        default=None,
        metadata={
            "help": "share of tokens masked for a masked LM (default: the run's "
            "--mlm-probability, as its run_config.json records it, else 0.15)"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    threads: int = field(default=0, metadata={"help": "CPU threads (0 = torch's default)"})

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.mlm_probability is not None:
            check_fraction("mlm_probability", self.mlm_probability)


def _text_blocks(
    specs: list[str], tokenizer: TextTokenizer, block_len: int, settings: EvaluateSettings
) -> PackedBlocks:
    documents = iter_documents(specs, glob=settings.glob, text_field=settings.text_field)
    texts = [d.text for d in tqdm(documents, desc="reading", unit=" documents")]
    logger.info("tokenizing %d documents", len(texts))
    stream = [t for ids in tokenizer.encode_batch(texts) for t in (*ids, tokenizer.sep_id)]
    if len(stream) == len(texts):  # separators alone: a loss of 0 / 0
        raise ValueError(f"{', '.join(specs)}: no text (its {len(texts)} documents are empty)")
    count = len(stream) // block_len
    if count == 0:
        raise ValueError(
            f"{', '.join(specs)}: {len(stream)} tokens, fewer than one block of {block_len} "
            f"(each --data is scored on its own: put short files in one folder to score them "
            f"together)"
        )
    # as the token cache keeps them: every file's are held until the last is scored
    tokens = np.asarray(stream, dtype=token_dtype(tokenizer.vocab_size))
    return PackedBlocks(tokens, block_len, np.arange(count))


def _labelled(spec: str, label_field: str) -> bool:
    """Whether `spec` is a JSONL or CSV file whose first record has a label."""
    path = Path(spec)
    if not (is_jsonl(path) or is_csv(path)) or not path.is_file():
        return False
    records = iter_csv(path, ()) if is_csv(path) else iter_jsonl(path)
    try:
        _, record = next(records)
    except (ValueError, StopIteration):  # malformed: the text reader will say where
        return False
    return label_field in record


def _run_setting(path: str | Path, section: str, name: str) -> Any:
    """A setting of the run that saved the checkpoint at `path`, as the run_config.json
    beside it records it; None without one (a model saved by other means) or that setting."""
    file = Path(path) / RUN_CONFIG_NAME
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text()).get(section, {}).get(name)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}:{err.lineno}: not valid JSON ({err.msg})") from err


def classifier_length(path: str | Path, config: LinformerConfig) -> int:
    """The length the classifier at `path` was fine-tuned at: `finetune --max-seq-len`, as
    the run_config.json beside each of its checkpoints records it, else the model's
    max_seq_len (0 there, or no run config: a model saved by other means)."""
    return _run_setting(path, "finetune", "max_seq_len") or config.max_seq_len


def load_for_classifier(
    path: str | Path,
    spec: str | Path,
    *,
    num_labels: int,
    text_field: str = "text",
    label_field: str = "label",
) -> ClassificationData:
    """`spec`'s labelled examples as the classifier at `path` was fine-tuned to read them: its
    tokenizer, labels, length (`classifier_length`) and truncation rule; logs what was cut.

    Raises:
        ValueError / FileNotFoundError: for a missing checkpoint or malformed data.
    """
    config = hub.read_config(path)["config"]
    max_len = classifier_length(path, config)
    data = load_classification(
        spec,
        load_tokenizer(path, model_vocab_size=config.vocab_size),
        max_seq_len=max_len,
        num_labels=num_labels,
        label2id=config.label2id or {},
        text_field=text_field,
        label_field=label_field,
        truncation=config.truncation or "head",  # unset: fine-tuned before the field
    )
    logger.info("%s reads %s", path, data.describe_truncation(max_len))
    return data


def evaluate_checkpoint(path: str | Path, settings: EvaluateSettings) -> dict[str, Any]:
    """Evaluates a saved model: loss / perplexity on text (masked tokens, or next tokens for a
    causal LM), or accuracy / F1 of a classifier on labelled JSONL.

    Returns:
        {data name: {metric: value}}.

    Raises:
        ValueError / FileNotFoundError: for a missing or corrupt checkpoint or bad data.
    """
    if not settings.data:
        raise ValueError("evaluate needs --data")
    use_threads(settings.threads)
    data, batch_size = settings.data, settings.batch_size
    meta = hub.read_encoder_config(path, f"evaluate it with `linformer seq2seq evaluate {path}`")
    target = resolve_device(settings.device)
    config = meta["config"]
    tokenizer = load_tokenizer(path, model_vocab_size=config.vocab_size)
    if (
        settings.mlm_probability is not None
        and meta["architecture"] != LinformerForMaskedLM.__name__
    ):
        raise ValueError(
            f"mlm_probability is the masking of a masked LM; {path} is a {meta['architecture']}"
        )
    if meta["architecture"] == LinformerForSequenceClassification.__name__:
        model = LinformerForSequenceClassification.from_pretrained(path)
        metrics: dict[str, Any] = {}
        for spec in data:
            labelled = load_for_classifier(
                path,
                spec,
                num_labels=model.num_labels,
                text_field=settings.text_field,
                label_field=settings.label_field,
            )
            evaluator = ClassificationEvaluator(
                labelled, tokenizer.pad_id, batch_size, model.num_labels, verbose=True
            )
            metrics[spec] = evaluator(model.to(target).eval(), target)
        return metrics
    causal = meta["architecture"] == LinformerForCausalLM.__name__
    if not causal and meta["architecture"] != LinformerForMaskedLM.__name__:
        raise ValueError(
            f"{path} is a {meta['architecture']}, a backbone with no language-model or "
            f"classification head (as `convert` writes it): a perplexity would score a head "
            f"drawn at random. Fine-tune it first: linformer finetune --init {path} --data "
            f"... --eval ..."
        )
    for spec in data:
        if _labelled(spec, settings.label_field):
            logger.warning(
                "%s is not a classifier (%s, no classification head): the labels in %s are "
                "ignored and its texts scored for %s perplexity. For accuracy and F1, "
                "fine-tune it first: linformer finetune --init %s --data ... --eval ...",
                path,
                meta["architecture"],
                spec,
                "next-token" if causal else "masked-LM",
                path,
            )
    model = (LinformerForCausalLM if causal else LinformerForMaskedLM).from_pretrained(path)
    rate = settings.mlm_probability or _run_setting(path, "train", "mlm_probability") or 0.15
    if not causal:  # the run's rate, so the perplexity compares with its own val_ppl
        logger.info("masking %.0f%% of the tokens", 100 * rate)
    # each on its own, as a classifier's (one pooled row before); all read first, so a file
    # of less than a block is named before the others are scored
    texts = {spec: _text_blocks([spec], tokenizer, config.max_seq_len, settings) for spec in data}
    metrics = {}
    for spec, blocks in texts.items():
        schedule = RowSchedule(len(blocks), batch_size, 1, 1, 0)
        batches = LMBatches(blocks, tokenizer, schedule, rate, causal=causal)
        metrics[spec] = LMEvaluator(batches, batch_size, verbose=True)(model.to(target), target)
    return metrics
