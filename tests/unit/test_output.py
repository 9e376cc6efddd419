"""How a worker's output is cut into lines: progress bars, CRLF, and the watchdog's control lines."""

from __future__ import annotations

from hora.runner.supervisor import ControlFilter, LineSplitter
from hora.runner.watchdog import CONTROL


def test_whole_lines_pass_through_and_partial_lines_wait() -> None:
    split = LineSplitter(interval_s=1.0)
    assert split.feed("a\nb", now=0.0) == ["a"]
    assert split.feed("c\r\nd\n", now=0.1) == ["bc", "d"]
    assert split.close() == []


def test_a_crlf_split_across_reads_is_one_line_end() -> None:
    split = LineSplitter(interval_s=1.0)
    assert split.feed("line\r", now=0.0) == []
    assert split.feed("\nnext\n", now=0.0) == ["line", "next"]


def test_progress_bar_shows_its_newest_state_at_most_once_per_interval() -> None:
    split = LineSplitter(interval_s=1.0)
    shown = split.feed("\r  0%", now=0.0)
    assert shown == ["  0%"]
    shown = [line for i in range(1, 50) for line in split.feed(f"\r {i:2d}%", now=i / 100)]
    assert shown == []  # within the interval: nothing more
    assert split.due() == 1.0
    assert split.redraw(now=1.0) == [" 49%"]  # the quiet stream's newest state, once due
    assert split.redraw(now=2.0) == []
    assert split.feed("\r100%\n", now=1.1) == ["100%"]  # a finished line is always shown
    assert split.feed("done\n", now=1.2) == ["done"]


def test_a_redraw_left_at_the_end_is_shown_once() -> None:
    split = LineSplitter(interval_s=1.0)
    assert split.feed("\rstep 1", now=0.0) == ["step 1"]
    assert split.feed("\rstep 2", now=0.5) == []
    assert split.close() == ["step 2"]


def test_control_lines_are_taken_out_even_when_split_across_reads() -> None:
    control = ControlFilter()
    line = f"{CONTROL}pid 4242\n"
    text, found = control.feed("hello\n" + line[:7])
    assert (text, found) == ("hello\n", [])
    text, found = control.feed(line[7:] + f"world{CONTROL}exit -9\n")
    assert (text, found) == ("world", [("pid", 4242), ("exit", -9)])


def test_a_nul_byte_that_is_not_a_control_line_is_kept() -> None:
    control = ControlFilter()
    assert control.feed("a\0b\n") == ("a\0b\n", [])
    assert control.feed("tail\0") == ("tail", [])
    assert control.close() == "\0"
