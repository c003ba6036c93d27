"""A config file that is not UTF-8 text (saved as Latin-1 / Windows-1252, or UTF-16 by Notepad) stops every verb
that reads configs with one line naming the file and the fix, instead of a ``UnicodeDecodeError`` traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_config

from lightning_lora.cli import main


@pytest.mark.parametrize("verb", ["fit", "plan", "cache"])
def test_a_config_that_is_not_utf8_is_one_line(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], verb: str
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    text = config.read_text()
    config.write_bytes(("# caf\xe9 photos\n" + text).encode("cp1252"))
    with pytest.raises(SystemExit) as exit_info:
        main([verb, "--config", str(config)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line]
    assert len(lines) == 1, lines
    assert f"--config {config}: the file is not UTF-8 text (byte 0xe9 on line 1)" in lines[0]
    assert "save it as UTF-8" in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
