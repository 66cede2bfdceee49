"""bench-task's settings and variants: which converted models it compares (`exact@N`,
`kK@N`, with `:after` for a Linformer converted from the bench's own fine-tuned exact model),
parsed and checked before any work."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from ..checks import check_choice, check_non_negative, check_positive
from ..config import PROJECTIONS, TRUNCATIONS, check_proj_dim
from ..files import check_output_path
from ..training.finetune_settings import DEFAULT_TRUNCATION, PROJECTION_MODES, FinetuneSettings
from ..training.settings import check_lr, check_threads

_VARIANT = re.compile(r"(exact|k(\d+))@(\d+)((?::\w+)*)")
AFTER = "after"  # the variant suffix: convert the fine-tuned exact@N, then fine-tune briefly


class Variant(NamedTuple):
    """One bench-task variant, parsed from its name (`parse_variants`)."""

    name: str
    proj_dim: int | None  # None: exact attention
    max_seq_len: int
    projection: str
    after: bool  # converted from this bench's fine-tuned exact@N instead of the source

    @property
    def exact(self) -> str:
        """The exact variant of the same length: what an :after variant converts."""
        return f"exact@{self.max_seq_len}"


@dataclass(kw_only=True)
class TaskBenchSettings:
    """The corpus, the variants and the fine-tuning budget every variant gets."""

    train: str = field(default="", metadata={"help": "training JSONL or CSV", "required": True})
    val: str = field(default="", metadata={"help": "validation JSONL or CSV", "required": True})
    test: str = field(default="", metadata={"help": "test JSONL or CSV", "required": True})
    source: str = field(
        default="", metadata={"help": "Hugging Face model dir (default: all-MiniLM-L6-v2)"}
    )
    variants: str = field(
        default="exact@512,k256@2048,k128@2048,exact@2048",
        metadata={
            "help": "comma-separated exact@N or kK@N[:KIND][:after] (N: max_seq_len, K: "
            "proj_dim, KIND: projection, default linear; :after converts this bench's "
            "fine-tuned exact@N, head kept, then fine-tunes --after-epochs at --after-lr)"
        },
    )
    epochs: int = field(default=1, metadata={"help": "passes over the training set"})
    batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch"})
    grad_accum_steps: int = field(
        default=1,
        metadata={"help": "micro-batches per step (a step sees batch_size x this sequences)"},
    )
    lr: float = field(default=0.0, metadata={"help": "peak learning rate (0 = finetune's)"})
    projections: str = field(
        default=FinetuneSettings.projections,  # finetune's default, defined once
        metadata={"help": "freeze or train the sequence projections (E, F)"},
    )
    truncation: str = field(
        default=DEFAULT_TRUNCATION,  # finetune's
        metadata={"help": "what a text longer than a variant's N keeps: head, tail or head+tail"},
    )
    after_epochs: int = field(
        default=2, metadata={"help": "epochs of an :after variant (from the exact classifier)"}
    )
    after_lr: float = field(default=3e-5, metadata={"help": "peak learning rate of :after"})
    calibration_texts: int = field(
        default=8, metadata={"help": "stdlib windows for the projection init"}
    )
    distill_steps: int = field(
        default=0,
        metadata={
            "help": "before fine-tuning, distil each Linformer variant this many steps (of 4 "
            "documents) against the exact model at its length, on the training texts "
            "(labels unused); not :after ones, converted from the bench's own classifier, "
            "not from a Hugging Face teacher; 0 = no distillation"
        },
    )
    threads: int = field(default=0, metadata={"help": "CPU threads (0 = torch's default)"})
    seed: int = field(default=0, metadata={"help": "seed of conversion and fine-tuning"})
    work_dir: str = field(default="runs/bench_task", metadata={"help": "models and runs"})
    out: str = field(
        default="benchmarks/longdoc/report", metadata={"help": "writes OUT.json, .md, .png"}
    )

    def __post_init__(self) -> None:
        parse_variants(self.variants)
        names = ("epochs", "batch_size", "grad_accum_steps", "after_epochs", "calibration_texts")
        for name in names:
            check_positive(name, getattr(self, name))
        check_threads(self.threads)
        check_output_path(self.work_dir, directory=True, flag="--work-dir")  # was Errno 17
        check_lr("lr", self.lr, zero="0 = finetune's")
        check_lr("after_lr", self.after_lr)
        check_choice("projections", self.projections, PROJECTION_MODES)
        check_choice("truncation", self.truncation, TRUNCATIONS)
        check_non_negative("distill_steps", self.distill_steps)


def parse_variants(spec: str) -> list[Variant]:
    """`exact@512,k256@2048,k128@2048:adaptive,k512@2048:adaptive:after` -> Variants; a
    Linformer variant without `:KIND` is `linear` (calibrated init).

    Raises:
        ValueError: naming the first malformed variant, unknown projection kind, K
            outside [1, N] or (conv, pool) not dividing N, a variant named twice, or an
            :after variant listed before its exact@N.
    """
    variants: list[Variant] = []
    for name in (part.strip() for part in spec.split(",")):
        match = _VARIANT.fullmatch(name)
        suffixes = match.group(4).split(":")[1:] if match else []
        after = suffixes[-1:] == [AFTER]
        kinds = suffixes[:-1] if after else suffixes
        if match is None or len(kinds) > 1 or (match.group(1) == "exact" and suffixes):
            raise ValueError(
                f"variant {name!r} is not exact@N or kK@N[:KIND][:after] "
                f"(e.g. exact@512, k256@2048, k128@2048:adaptive, k512@2048:adaptive:after)"
            )
        projection = kinds[0] if kinds else "linear"
        check_choice("projection", projection, PROJECTIONS)
        proj_dim = int(match.group(2)) if match.group(2) else None
        max_seq_len = int(match.group(3))
        if max_seq_len < 1:
            raise ValueError(f"variant {name!r}: N must be >= 1")
        if proj_dim is not None:
            try:
                check_proj_dim(proj_dim, max_seq_len, projection)
            except ValueError as err:
                raise ValueError(
                    f"variant {name!r} (K = proj_dim, N = max_seq_len): {err}"
                ) from None
        variants.append(Variant(name, proj_dim, max_seq_len, projection, after))
    names = [v.name for v in variants]
    if len(set(names)) < len(names):  # trained once, reported twice
        raise ValueError(f"variants names one twice: {spec!r}")
    for i, v in enumerate(variants):
        if v.after and v.exact in names[i + 1 :]:
            raise ValueError(f"{v.name} converts the fine-tuned {v.exact}: list {v.exact} first")
    return variants
