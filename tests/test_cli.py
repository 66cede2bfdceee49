import subprocess
import sys

import pytest

from linformer_kit import __version__
from linformer_kit.cli import main


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_bad_flag_value_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "many"])
    assert "invalid int value" in capsys.readouterr().err


def test_importing_the_plotting_modules_keeps_the_users_matplotlib_backend():
    """Figures are built without pyplot: a notebook's backend must survive the import."""
    code = (
        "import matplotlib; matplotlib.use('svg'); "
        "import linformer_kit.analysis.plots, linformer_kit.bench.plots, "
        "linformer_kit.interop.distill_report, linformer_kit.training.compare, "
        "linformer_kit.cli; "
        "print(matplotlib.get_backend())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "svg"
