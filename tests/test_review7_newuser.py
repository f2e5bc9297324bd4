"""Review 7 (a new user's first day): what a user meets following the README and the guides."""

from __future__ import annotations

import pytest

from mnemo.cli import main


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["train", "--eval-every", "10"], "mnemo train"),
        (["eval", "--checkpoint", ".", "--bogus"], "mnemo eval"),
        (["probe", "spectrum", "--checkpoint", ".", "--foo", "1"], "mnemo probe spectrum"),
        (["models", "--x"], "mnemo models"),
    ],
)
def test_an_unknown_flag_is_named_by_the_sub_command_whose_help_lists_the_flags(argv, prog, capsys):
    # a misspelt flag (--eval-every for --eval-interval) pointed at `mnemo --help`, which lists
    # only the sub-commands; the sub-command's own --help is where the flags are
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"{prog}: error: unrecognized arguments: "), err
    assert err[0].endswith(f"(see: {prog} --help)"), err
    assert argv[-1] in err[0]


def test_a_good_command_line_carries_no_parser_bookkeeping():
    from mnemo.cli import build_parser

    args = build_parser().parse_args(["probe", "spectrum", "--checkpoint", "."])
    assert not any(k.startswith("_mnemo") for k in vars(args)), vars(args)
    assert args.command == "probe" and args.probe_command == "spectrum"
