"""`linformer spectrum` (is the attention matrix low rank? paper Figure 1) and
`linformer attention-map` (one layer's and head's attention matrix for a text)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis import SpectrumSettings, spectrum_report, write_attention_map
from ..analysis.report import PLOT_NAME, RESULT_NAME
from .common import format_table
from .overrides import add_override_arguments, collect_overrides, exit_on_user_error


@exit_on_user_error
def run_spectrum(args: argparse.Namespace) -> None:
    """`linformer spectrum`: writes the spectrum JSON and figure, prints the recommended k."""
    settings = SpectrumSettings(**collect_overrides(args).get("spectrum", {}))
    report = spectrum_report(args.checkpoint, settings)
    n, index = report["seq_len"], report["index"]
    rows = [
        {
            "layer": layer["layer"],
            **{f"k@{100 * float(m):g}%": k for m, k in layer["k"].items()},
            f"mass@{index}": sum(layer["value_at_index"]) / len(layer["value_at_index"]),
        }
        for layer in report["layers"]
    ]
    print(
        f"{report['attention']} attention, {report['num_sequences']} sequences of n = {n} "
        f"({report['mean_real_tokens']:.0f} real tokens on average); k from head-averaged curves:"
    )
    print(format_table(rows))
    best = report["recommendation"]
    ratio = best["cost_ratio"]
    bound = [layer["proj_dim"] for layer in report["layers"] if layer["proj_dim"] is not None]
    print(
        f"recommended k = {best['proj_dim']}: keeps {best['mass']:.0%} of the spectral mass in "
        f"every layer ({best['proj_dim_every_head']} for every single head)"
        + (  # a Linformer's P̄ is n x k: its spectrum cannot ask for more than its own k
            f"; of P̄ = softmax(Q(EK)ᵀ/√d), so at most the model's k = {max(bound)} (an exact "
            f"checkpoint's spectrum says which k a model needs)"
            if bound
            else ""
        )
    )
    print(
        f"theoretical cost vs exact attention at n = {ratio['n']} (the texts' mean real "
        f"length): time 2k/n = {ratio['time']:.3f}, "
        f"attention-matrix memory k/n = {ratio['memory']:.3f} (per head: Linformer 4nkd "
        f"multiply-adds for E K, F V, Q(EK)ᵀ, P̄(FV) vs 2n²d for Q Kᵀ, P V)"
    )
    out = Path(settings.out)
    print(f"wrote {out / RESULT_NAME} and {out / PLOT_NAME}")


@exit_on_user_error
def run_attention_map(args: argparse.Namespace) -> None:
    """`linformer attention-map`: draws one layer and head's attention for a text."""
    rows, cols = write_attention_map(args.checkpoint, args.text, args.layer, args.head, args.out)
    print(f"wrote {args.out}: layer {args.layer}, head {args.head}, {rows} x {cols} map")


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `spectrum` and `attention-map` subcommands."""
    spectrum = commands.add_parser(
        "spectrum",
        help="singular-value spectrum of every layer's and head's attention matrix (Figure 1)",
    )
    spectrum.add_argument("checkpoint", help="a model directory (e.g. runs/x/best)")
    add_override_arguments(spectrum, SpectrumSettings, "spectrum")
    spectrum.set_defaults(func=run_spectrum)

    maps = commands.add_parser(
        "attention-map", help="plot one layer's and head's attention matrix for a text"
    )
    maps.add_argument("checkpoint", help="a model directory with tokenizer.json")
    maps.add_argument("--text", required=True, help="the text to encode")
    maps.add_argument("--layer", type=int, default=0, help="layer, 0-based (default: 0)")
    maps.add_argument("--head", type=int, default=0, help="head, 0-based (default: 0)")
    maps.add_argument(
        "--out",
        required=True,
        help="output figure: its suffix names the format (.png, .pdf, .svg, ...)",
    )
    maps.set_defaults(func=run_attention_map)
