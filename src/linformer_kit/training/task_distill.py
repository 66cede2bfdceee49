"""Task-level knowledge distillation for fine-tuning (Hinton et al. 2015; the prediction-layer
loss of DistilBERT and TinyBERT): the student learns the labels and, beside them, a fine-tuned
teacher's softened predictions on the same training texts.

Why here: a Linformer converted from an exact model and fine-tuned on a few hundred long
documents ends well below the exact model fine-tuned at the same length (README, long
documents), while the exact model is affordable once, as a teacher. Its predictions on the
training texts carry what it learned (how sure it is of each review) beyond the bare label.

The teacher runs once, in eval mode, before training: its logits do not depend on the
student's step, so they are computed in one pass and each micro-batch reads its rows. The
teacher reads every text with its own tokenizer, length and truncation rule.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import hub
from ..data.classification import ClassificationData
from ..data.tokenizer import load_tokenizer
from ..models import LinformerForSequenceClassification
from .batches import in_order
from .evaluate import load_for_classifier

logger = logging.getLogger(__name__)


def check_teacher(teacher: str | Path) -> dict[str, Any]:
    """`teacher`'s saved config (`hub.read_config`), if it is a fine-tuned classifier.

    Raises:
        FileNotFoundError: for a folder without a saved model (`hub.read_config`'s).
        ValueError: naming --teacher, for another kind of model.
    """
    meta = hub.read_config(teacher)
    if meta["architecture"] != LinformerForSequenceClassification.__name__:
        raise ValueError(
            f"--teacher {teacher} is a {meta['architecture']}, not a fine-tuned classifier "
            f"(a directory written by `linformer finetune`, e.g. runs/x/best)"
        )
    return meta


def check_teacher_labels(
    teacher: str | Path,
    meta: dict[str, Any],
    num_labels: int,
    label2id: dict[str, int] | None,
    source: str | Path,
) -> None:
    """Raises ValueError unless the teacher (`meta`, its `check_teacher`) predicts the
    student's classes: `num_labels` of them, named by `label2id` as the data `source` names
    them. Checked before any model loads: a mismatch was named after the probe's pass."""
    saved = meta["model_kwargs"].get("num_labels")
    names = meta["config"].label2id
    if saved != num_labels or (names or None) != (label2id or None):
        raise ValueError(
            f"--teacher {teacher} predicts {saved} classes ({names}); {source} has "
            f"{num_labels} ({label2id}): the teacher must be fine-tuned on the same labels"
        )


@torch.no_grad()
def teacher_logits(
    teacher: str | Path,
    student_data: ClassificationData,
    *,
    num_labels: int,
    text_field: str,
    label_field: str,
    batch_size: int,
    device: torch.device,
) -> Tensor:
    """The teacher's logits on every example of `student_data`, read from the same file.

    Args:
        teacher: a fine-tuned classifier checkpoint (from `finetune`).
        student_data: the student's training examples; the teacher must know their classes.
        num_labels: the student's number of classes.
        text_field, label_field: field (JSONL) or column (CSV) names.
        batch_size: examples per teacher forward pass.
        device: where the teacher runs.

    Returns:
        float32 (N, num_labels), row i for example i of `student_data`.

    Raises:
        ValueError: if `teacher` is not a classifier, or its classes differ from the data's.
    """
    meta = check_teacher(teacher)
    check_teacher_labels(teacher, meta, num_labels, student_data.label2id, student_data.source)
    model = LinformerForSequenceClassification.from_pretrained(teacher).to(device)
    data = load_for_classifier(
        teacher,
        student_data.source,
        num_labels=num_labels,
        text_field=text_field,
        label_field=label_field,
    )
    batches = in_order(
        data, load_tokenizer(teacher).pad_id, batch_size, device, desc="teacher logits"
    )
    out = torch.cat([model(**batch).logits.float().cpu() for batch in batches])
    accuracy = float((out.argmax(-1) == torch.tensor(data.labels)).double().mean())
    logger.info("the teacher's accuracy on the training examples: %.3f", accuracy)
    return out


def distillation_loss(
    logits: Tensor, teacher: Tensor, labels: Tensor, *, weight: float, temperature: float
) -> Tensor:
    """(1 - weight) * cross-entropy with the labels + weight * T^2 * KL(teacher_T || student_T),
    both distributions softened by the temperature T (the T^2 keeps the soft term's gradient
    on the scale of the hard one's as T changes: Hinton et al. 2015).

    Args:
        logits: the student's (B, C).
        teacher: the teacher's (B, C).
        labels: class ids (B,).
        weight: share of the soft term, in [0, 1].
        temperature: T > 0.
    """
    hard = F.cross_entropy(logits.float(), labels)
    student_t = F.log_softmax(logits.float() / temperature, -1)
    teacher_t = F.log_softmax(teacher.float() / temperature, -1)
    soft = F.kl_div(student_t, teacher_t, log_target=True, reduction="batchmean")
    return (1.0 - weight) * hard + weight * temperature**2 * soft


class DistillationObjective:
    """The Trainer's loss for a batch carrying `teacher_logits`: `distillation_loss`."""

    def __init__(self, weight: float, temperature: float) -> None:
        self.weight, self.temperature = weight, temperature

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        inputs = dict(batch)
        teacher, labels = inputs.pop("teacher_logits"), inputs.pop("labels")
        logits = model(**inputs).logits
        return distillation_loss(
            logits, teacher, labels, weight=self.weight, temperature=self.temperature
        )
