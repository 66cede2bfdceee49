import argparse
import re
import subprocess
import sys

import pytest

from linformer_kit import __version__
from linformer_kit.cli import build_parser, main


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_bad_flag_value_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "many"])
    assert "invalid int value" in capsys.readouterr().err
    # a flag taking a number, 'none' or a list said "invalid convert value: '8,abc'"
    for value, expected in [
        ("8,abc", "an integer, 'none' or a comma-separated list of them (A,B,...); got '8,abc'"),
        ("", "(A,B,...); got ''"),
    ]:
        with pytest.raises(SystemExit):
            main(["pretrain", "--proj-dim", value])
        assert expected in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pretrain", "--ffn-dim", "abc"])
    assert "--ffn-dim: expected an integer or 'none'; got 'abc'" in capsys.readouterr().err


def test_a_user_error_ends_with_its_message_and_exit_status_2(tmp_path, capsys):
    missing = tmp_path / "missing"
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--data", str(missing), "--output-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    message = f"linformer pretrain: error: data path {missing} does not exist"
    assert capsys.readouterr().err == message + "\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--from", str(missing)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "linformer convert: error: --out DIR is required (or pass --report)\n"
    )


def test_every_flag_of_every_subcommand_says_what_it_does():
    """Beyond its default: `--proj-dim` must say that `none` means exact attention."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for name, parser in commands.choices.items():
        for action in parser._actions:
            text = re.sub(r"\((default: .*|required)\)$", "", action.help or "").strip()
            if not text:
                silent.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert silent == []
    pretrain_help = commands.choices["pretrain"].format_help()
    assert "none = exact attention" in " ".join(pretrain_help.split())


def test_importing_the_package_keeps_the_users_matplotlib_backend_and_leaves_dynamo_out():
    """Figures are built without pyplot: a notebook's backend must survive the import. And
    the import leaves torch.compile's Dynamo unloaded (1.4 s of every process's start, a
    CLI command's or a spawned worker's), until something compiles."""
    code = (
        "import sys, matplotlib; matplotlib.use('svg'); "
        "import linformer_kit.analysis.plots, linformer_kit.bench.plots, "
        "linformer_kit.interop.distill_report, linformer_kit.training.compare, "
        "linformer_kit.cli; "
        "print(matplotlib.get_backend(), 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["svg", "False"]


def test_the_command_also_runs_as_a_module():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "linformer_kit.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "pretrain" in out.stdout
