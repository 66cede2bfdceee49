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
