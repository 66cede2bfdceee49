"""Linear-probe start of a classifier head (LP-FT: Kumar et al. 2022, "Fine-Tuning can
Distort Pretrained Features and Underperform Out-of-Distribution"): before fine-tuning, the
head's output layer is fitted by logistic regression on the frozen backbone's features.

Why: a new head (weights of std 0.02) puts out logits near zero, and AdamW moves each weight
by about the learning rate per step, so at a pretrained backbone's learning rate a few dozen
steps end with the head still near zero: one class predicted for everything, while the
backbone's gradients flow through a random head. From the probe, step 0 already scores what
the frozen features can tell apart, and fine-tuning starts from there.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models import LinformerForSequenceClassification
from .batches import LabelledRows, in_order

logger = logging.getLogger(__name__)

# L2 penalties the probe chooses from (scikit-learn's C = 1 is 1 / 2N: 0.0025 for 200 examples).
PENALTIES = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
FOLDS = 5  # cross-validation folds of the penalty


@torch.no_grad()
def head_features(
    model: LinformerForSequenceClassification,
    data: LabelledRows,
    pad_id: int,
    batch_size: int,
    device: torch.device,
) -> Tensor:
    """What the head's output layer sees for every example in training, dropout included:
    (N, dim). A probe fitted on dropout-free features can need weights so large that
    dropout's noise swamps its logits once training starts."""
    was_training = model.training
    model.train()
    features = []
    for batch in in_order(data, pad_id, batch_size, device, desc="probe features"):
        hidden = model.linformer(batch["input_ids"], batch["key_padding_mask"]).last_hidden_state
        pooled = model.pool(hidden, batch["key_padding_mask"])  # (B, dim)
        features.append(model.head[:-1](pooled).float().cpu())
    model.train(was_training)
    return torch.cat(features)


def _logistic_regression(
    z: Tensor, labels: Tensor, num_labels: int, penalty: float, max_iter: int
) -> tuple[Tensor, Tensor]:
    """Weight and bias minimising mean cross-entropy + penalty * |weight|^2 (L-BFGS)."""
    weight = torch.zeros(num_labels, z.shape[1], dtype=z.dtype, requires_grad=True)
    bias = torch.zeros(num_labels, dtype=z.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(z @ weight.T + bias, labels) + penalty * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach(), bias.detach()


def cross_validates(examples: int, folds: int = FOLDS) -> bool:
    """Whether `fit_linear_probe` picks its penalty by cross-validation: 2 examples a fold;
    fewer take the strongest penalty."""
    return examples >= 2 * folds


def fit_linear_probe(
    features: Tensor,
    labels: Tensor,
    num_labels: int,
    *,
    strengths: tuple[float, ...] = PENALTIES,
    folds: int = FOLDS,
    max_iter: int = 200,
) -> tuple[Tensor, Tensor, float]:
    """Multinomial logistic regression on standardised features, folded back to the raw ones,
    with the L2 penalty of lowest cross-validated log-loss.

    The penalty matters: with fewer examples than features the classes separate and an
    unpenalised probe drives the training loss to zero, leaving fine-tuning no gradient.

    Args:
        features: (N, D) inputs.
        labels: (N,) class ids in [0, num_labels).
        num_labels: number of classes.
        strengths: penalties tried (objective: mean loss + penalty * |w|^2).
        folds: cross-validation folds, stratified (each class's examples dealt round
            them in turn); with fewer than 2 x folds examples, no cross-validation: the
            strongest penalty.
        max_iter: L-BFGS iterations per fit.

    Returns:
        weight (num_labels, D), bias (num_labels,) for the raw features, and the penalty.
    """
    features = features.double()
    # The population std: one example has std 0, not nan (0 / 0). A column constant but for
    # float32 rounding (std ~1e-7 of its mean) is constant: scaled to unit variance, its
    # weight came back as 1e6.
    mean, std = features.mean(0), features.std(0, correction=0)
    std = torch.where(std <= 1e-6 * mean.abs() + 1e-12, torch.inf, std)
    z = (features - mean) / std  # (N, D); 0 in constant columns
    # Stratified: a file cycling through 5 classes put each class in one fold of i mod 5,
    # held out against a fit that never saw it (the penalty then picked at random).
    fold = torch.empty_like(labels)
    fold[labels.argsort(stable=True)] = torch.arange(len(labels)) % folds

    def heldout_loss(penalty: float) -> float:
        total = 0.0
        for f in range(folds):
            train, test = fold != f, fold == f
            weight, bias = _logistic_regression(
                z[train], labels[train], num_labels, penalty, max_iter
            )
            total += float(
                F.cross_entropy(z[test] @ weight.T + bias, labels[test], reduction="sum")
            )
        return total

    penalty = strengths[-1]  # the strongest, where too few examples to cross-validate
    if cross_validates(len(labels), folds):
        penalty = min(strengths, key=heldout_loss)
    weight, bias = _logistic_regression(z, labels, num_labels, penalty, max_iter)
    return weight / std, bias - (weight / std) @ mean, penalty


def init_head_from_probe(
    model: LinformerForSequenceClassification,
    data: LabelledRows,
    pad_id: int,
    batch_size: int,
    device: torch.device,
) -> float:
    """Sets the head's output layer to the linear probe of `data` (training examples).

    Returns:
        The probe's accuracy on `data`.
    """
    features = head_features(model, data, pad_id, batch_size, device)
    labels = torch.tensor(list(data.labels), dtype=torch.long)
    weight, bias, penalty = fit_linear_probe(features, labels, model.num_labels)
    output = model.head[-1]
    with torch.no_grad():
        output.weight.copy_(weight.to(output.weight))
        output.bias.copy_(bias.to(output.bias))
    accuracy = float(((features.double() @ weight.T + bias).argmax(-1) == labels).double().mean())
    chosen = (
        f"by {FOLDS}-fold cross-validation"
        if cross_validates(len(labels))
        else f"the strongest: fewer than {2 * FOLDS} examples to cross-validate"
    )
    logger.info(
        "head started from a linear probe on the frozen backbone (L2 penalty %g, %s; "
        "training accuracy %.3f)",
        penalty,
        chosen,
        accuracy,
    )
    return accuracy
