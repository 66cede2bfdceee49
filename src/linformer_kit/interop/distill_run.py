"""Running a distillation from files: which text is distilled on and which is scored (full-
length windows of text files, or whole documents padded per batch), and the model directory
that is converted, distilled and saved back (`linformer distill`)."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from ..checks import check_positive
from ..data.corpus import list_files
from ..files import atomic_write, check_output_path, exclusive
from ..models import LinformerModel
from .bert import convert_hf_model, read_hf_config
from .convert import DEFAULT_SHAPE, convert_to_dir
from .distill import DistillSettings, HeldOut, distill
from .report import TOKENIZER_NAME, document_ids, model_tokenizer, stdlib_files, text_windows

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DistillData:
    """Which windows are distilled on and which are scored (also `linformer distill` flags)."""

    texts: int = field(default=256, metadata={"help": "distillation windows"})
    per_file: int = field(default=8, metadata={"help": "most distillation windows per file"})
    heldout_texts: int = field(default=64, metadata={"help": "held-out windows scored"})
    calibration_texts: int = field(
        default=16, metadata={"help": "calibration windows of the attention init"}
    )
    glob: str = field(default="**/*.txt", metadata={"help": "files read inside --data dirs"})

    def __post_init__(self) -> None:
        for name in ("texts", "per_file", "heldout_texts", "calibration_texts"):
            check_positive(name, getattr(self, name))


def distillation_files(data: list[str] | None, glob: str) -> list[Path]:
    """The files distilled on: those `data` names (files, or directories' `glob` matches), or
    the stdlib's calibration split when None.

    Raises:
        FileNotFoundError: for a missing path or a directory without matches.
        ValueError: if a file is one of the held-out files the cosine is scored on.
    """
    if not data:
        return stdlib_files("calibration")
    files = [file for spec in data for file in list_files(spec, glob)]
    scored = {file.resolve() for file in stdlib_files("heldout")}
    overlap = [file for file in files if file.resolve() in scored]
    if overlap:
        raise ValueError(
            f"{len(overlap)} data files (e.g. {overlap[0]}) are held-out files the cosine is "
            "scored on; distil on other text (default: the stdlib's calibration split)"
        )
    return files


def split_documents(
    documents: list[str], heldout: list[str] | None, data: DistillData, seed: int
) -> tuple[list[str], list[str]]:
    """The documents distilled on and those scored: `heldout` when given, else
    `data.heldout_texts` documents drawn (by `seed`) from `documents`; at most `data.texts`
    and `data.heldout_texts` of each.

    Raises:
        ValueError: if no document is left to distil on.
    """
    if heldout is None:
        order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed))
        shuffled = [documents[i] for i in order.tolist()]
        heldout, documents = shuffled[: data.heldout_texts], shuffled[data.heldout_texts :]
    if not documents:
        raise ValueError(
            f"no documents left to distil on after holding out {data.heldout_texts}; "
            "give more documents, fewer --heldout-texts or --heldout-documents"
        )
    return documents[: data.texts], heldout[: data.heldout_texts]


def distill_checkpoint(
    teacher_dir: str | os.PathLike,
    student_dir: str | os.PathLike,
    settings: DistillSettings,
    data: DistillData,
    *,
    files: list[Path] | None = None,
    documents: list[str] | None = None,
    heldout_documents: list[str] | None = None,
    proj_dim: int | None = None,
    sharing: str | None = None,
    projection: str | None = None,
    max_seq_len: int | None = None,
) -> list[dict[str, float | None]]:
    """Distils the Linformer in `student_dir` against the exact `teacher_dir` (extended to
    the student's max_seq_len, as `convert` extends it) and saves it back there (with the
    teacher's tokenizer.json). A `student_dir` without a model is first filled by converting
    the teacher with `proj_dim`, `sharing`, `projection` and `max_seq_len`.

    Two kinds of text: full-length windows cut from `files` (scored on windows of the
    stdlib's held-out split), or whole `documents`, one padded sequence each, cut at
    max_seq_len (scored on `heldout_documents`, or on documents held out of `documents`).

    Args:
        teacher_dir: Hugging Face BERT/RoBERTa directory with tokenizer.json.
        student_dir: Linformer model directory (`linformer convert` output), or a new one.
        settings: the recipe.
        data: window / document counts.
        files: the distillation text (`distillation_files`), when no `documents`.
        documents: texts distilled on whole.
        heldout_documents: texts scored, with `documents`.
        proj_dim: k of a newly converted student (None: 128).
        sharing: sharing of a newly converted student (None: layerwise).
        projection: projection kind of a newly converted student (None: linear).
        max_seq_len: length of a newly converted student (None: the teacher's).
            Each of these four given for an existing student must be its own.

    Returns:
        `distill`'s history, scored on the held-out windows or documents.

    Raises:
        FileNotFoundError: for a missing teacher, tokenizer or data file.
        ValueError: if the student does not match the teacher or the shape asked for, or
            on bad settings.
    """
    teacher_dir, student_dir = Path(teacher_dir), Path(student_dir)
    # a file: "--out ... is a file", after the teacher was converted
    check_output_path(student_dir, directory=True, flag="--student")
    device = settings.torch_device()
    read_hf_config(teacher_dir)  # a missing teacher is named before anything else
    tokenizer = model_tokenizer(teacher_dir, "the text")
    asked = dict(proj_dim=proj_dim, sharing=sharing, projection=projection)
    asked = {name: value for name, value in asked.items() if value is not None}
    if max_seq_len is not None:
        asked["max_seq_len"] = max_seq_len
    if not (student_dir / "config.json").is_file():
        shape = {**DEFAULT_SHAPE, **asked}
        logger.info("no model in %s: converting %s with %s", student_dir, teacher_dir, shape)
        convert_to_dir(teacher_dir, student_dir, calibration_texts=data.calibration_texts, **shape)
    with exclusive(student_dir, "distillation"):  # two into one student: one's work lost
        student = LinformerModel.from_pretrained(student_dir)
        differ = [
            f"{name} {value} differs from the student's {getattr(student.config, name)}"
            for name, value in asked.items()
            if value != getattr(student.config, name)
        ]
        if differ:  # silently distilling another shape than the one asked for
            raise ValueError(
                f"{'; '.join(differ)} in {student_dir} (these flags shape a new student: "
                "leave them out, or give a new --student folder)"
            )
        n = student.config.max_seq_len
        teacher = convert_hf_model(teacher_dir, proj_dim=None, max_seq_len=n).to(device)
        if documents is None:
            mask = None
            ids = text_windows(tokenizer, files or [], n, data.texts, per_file=data.per_file)
            scored = text_windows(tokenizer, stdlib_files("heldout"), n, data.heldout_texts), None
        else:
            texts, heldout_texts = split_documents(
                documents, heldout_documents, data, settings.seed
            )
            ids, mask = document_ids(tokenizer, texts, n)
            scored = document_ids(tokenizer, heldout_texts, n)
        scored = [None if t is None else t.to(device) for t in scored]
        heldout = HeldOut.from_teacher(teacher, *scored)
        history = distill(student, teacher, ids, settings, key_padding_mask=mask, heldout=heldout)
        student.cpu().save_pretrained(student_dir)
        atomic_write(student_dir / TOKENIZER_NAME, partial(shutil.copy2, tokenizer))
        return history
