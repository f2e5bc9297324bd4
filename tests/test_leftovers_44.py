"""Session 44's leftovers at the command line."""

from __future__ import annotations

import io
import os
import sys

from mnemo.cli import main


def test_a_buffered_output_cut_by_its_reader_is_quiet_too(capsys, monkeypatch):
    # `mnemo models | head -1` without PYTHONUNBUFFERED: the table stayed in stdout's buffer, main
    # returned 0 and the interpreter's exit flush failed (exit 120, "Exception ignored ...
    # BrokenPipeError" on stderr); now the flush is main's and the cut reads as exit 141, quietly
    r, w = os.pipe()
    os.close(r)  # the reader is gone
    cut = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "w"), buffer_size=1 << 16))
    monkeypatch.setattr(sys, "stdout", cut)
    try:
        assert main(["models"]) == 141
        cut.flush()  # what Python does at exit
    finally:
        monkeypatch.undo()
        cut.close()
    assert capsys.readouterr().err == ""
