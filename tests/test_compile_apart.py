"""`CompileApart` read late: what a parent that first waits once the engine is done (`--videos-at-end`) sees."""

import sys
import time

from terra_cli.compile_apart import CompileApart

QUICK = [sys.executable, "-c", "import json; print(json.dumps({'compiled': True}))"]
# more than a pipe holds (64 KiB on Linux) before its JSON line, as a chatty library's output would be
CHATTY = [sys.executable, "-c", "import json\nfor _ in range(2000): print('x' * 200)\nprint(json.dumps({'compiled': True}))"]


def ended(child: CompileApart, within: float = 60.0) -> None:
    began = time.perf_counter()
    while child.process.poll() is None:
        assert time.perf_counter() - began < within
        time.sleep(0.05)


def test_a_child_done_before_a_late_wait_is_read_with_its_own_seconds():
    child = CompileApart("{}", QUICK)
    ended(child)
    time.sleep(1.5)  # the parent waits long after the child ended, and past the child's limit
    assert child.wait(timeout=1.0) == {"compiled": True} and child.error is None
    assert child.seconds < time.perf_counter() - child.started - 1.0  # counted to its end, not to the wait


def test_a_child_writing_more_than_a_pipe_holds_ends_unread():
    child = CompileApart("{}", CHATTY)
    ended(child)  # with its output in a pipe read only at the wait, it would block here
    assert child.wait(timeout=60) == {"compiled": True}


def test_a_child_still_running_at_its_limit_is_ended_with_one_line():
    child = CompileApart("{}", [sys.executable, "-c", "import time; time.sleep(120)"])
    assert child.wait(timeout=0.5) is None and child.error == "still compiling after 0.5 s: ended"
    assert child.process.poll() is not None and 0.5 <= child.seconds < 30


def test_a_failing_child_gives_its_last_error_line():
    child = CompileApart("{}", [sys.executable, "-c", "import sys; print('no compile', file=sys.stderr); sys.exit(3)"])
    assert child.wait(timeout=60) is None and child.error == "exit 3: no compile"
