"""`linformer bench-task`: downstream accuracy on a labelled long-document corpus. Converts a
pretrained model into several variants (exact truncated, Linformer at a longer length, exact
extended), fine-tunes each with the same budget and scores it on the test file, beside a
TF-IDF + logistic-regression baseline; writes JSON, a Markdown table and a PNG."""

from __future__ import annotations

import argparse
import logging

from tqdm.contrib.logging import logging_redirect_tqdm

from ..interop.task_bench import run_task_bench
from ..interop.task_bench_report import markdown_table, report_file
from ..interop.task_bench_settings import TaskBenchSettings
from .overrides import add_override_arguments, collect_overrides, exit_on_user_error


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer bench-task`: runs the variants and the baseline, prints the table."""
    logging.basicConfig(level=logging.INFO)
    settings = TaskBenchSettings(**collect_overrides(args).get("bench_task", {}))
    with logging_redirect_tqdm():  # log lines between progress bars, not inside them
        report = run_task_bench(settings)
    print(markdown_table(report["rows"]), end="")
    files = [report_file(settings.out, suffix) for suffix in (".json", ".md", ".png")]
    print(f"wrote {', '.join(str(f) for f in files if f.exists())}")


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `bench-task` subcommand."""
    parser = commands.add_parser(
        "bench-task",
        help="fine-tune converted variants (exact / Linformer / extended) on a labelled corpus",
    )
    add_override_arguments(parser, TaskBenchSettings, "bench_task")
    parser.set_defaults(func=run)
