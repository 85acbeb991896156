"""A scenario run's --out-dir: checked before any model loads, written by one run at a time, and
never a place where a run replaces a file that terra did not write for that scenario.

- `check_out_dir`: a folder (or one that can be made) that accepts files, whose results logs are
  regular files (a folder, /dev/full or a dangling link would fail the first append).
- `OutDirLock`: one run per folder (flock on a lock file inside it; the kernel drops the lock of a
  run that died, so a stale lock file is simply taken over).
- `plan_outputs`: which scenarios are done (resume), which changed since results.jsonl recorded
  them (refused without --overwrite), and which existing files this run may replace: those an
  earlier terra run recorded for the same scenario, or any with --overwrite, but never a file the
  run reads, nor a results log that is an input or not terra's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from terra_cli.errors import OutputError
from terra_cli.media.atomic import describe_os_error, unwritable_ancestor
from terra_cli.scenarios.spec import Scenario

RESULTS_NAME = "results.jsonl"
SHARD_RESULTS_GLOB = "results.shard-*.jsonl"  # data-parallel workers' logs, folded into RESULTS_NAME
LOCK_NAME = ".terra-scenarios.lock"


def results_logs(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [out_dir / RESULTS_NAME, *sorted(out_dir.glob(SHARD_RESULTS_GLOB))]


def read_results(path: Path) -> list[dict]:
    return read_log(path)[0]


def read_log(path: Path) -> tuple[list[dict], bool]:
    """A results log's records, and whether every line of it is terra's: a record (an object with
    an id and a status) or a line a crash cut short (it starts as one; that scenario runs again)."""
    if not Path(path).is_file():
        return [], True
    records, ours = [], True
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError):
            ours = ours and (not line.strip() or line.startswith("{"))
            continue
        if isinstance(record, dict):
            records.append(record)
        ours = ours and isinstance(record, dict) and {"id", "status"} <= set(record)
    return records, ours


def check_out_dir(out_dir: Path) -> None:
    """Before any model loads: one line naming what is wrong with --out-dir."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink() and not out_dir.exists():
        raise OutputError(f"--out-dir {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist")
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"--out-dir {out_dir} is a file; pass a folder")
    blocker = unwritable_ancestor(out_dir)
    if blocker is not None:
        raise OutputError(f"cannot write into --out-dir {out_dir}: {blocker} is not writable (permissions, a read-only "
                          "file system, or a virtual one such as /proc)")
    if out_dir.is_dir():
        for log in results_logs(out_dir):
            if os.path.lexists(log) and not log.is_file():
                raise OutputError(f"{log} is not a regular file (a folder, a device or a dangling link); move it away: "
                                  "terra appends one line per scenario to it")


def make_out_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(describe_os_error(exc, out_dir)) from exc
    return out_dir


# (real path of an out-dir, thread) -> [lock file descriptor, depth]: re-entrant in one thread only, so
# two threads of one process (a server) exclude each other like two processes do.
_held: dict[tuple[str, int], list] = {}


@contextlib.contextmanager
def OutDirLock(out_dir: Path) -> Iterator[None]:  # noqa: N802  (used like a class: `with OutDirLock(dir):`)
    """Hold --out-dir for this run; another run (any process) is refused with one line. Nested
    use in one thread (the CLI around `run_scenarios`) holds it once."""
    out_dir = make_out_dir(out_dir)
    key = (os.path.realpath(out_dir), threading.get_ident())
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    fd = _acquire(out_dir / LOCK_NAME, out_dir)
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        _release(out_dir / LOCK_NAME, fd)


def _acquire(path: Path, out_dir: Path) -> int | None:
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot lock --out-dir {out_dir}: {describe_os_error(exc, path)}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputError(f"--out-dir {out_dir} is in use by another terra run ({holder}); wait for it to finish "
                              "or pick another --out-dir") from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return None  # a file system without locks: one run at a time is then the user's to keep
            raise OutputError(f"cannot lock --out-dir {out_dir}: {exc.strerror or exc}") from exc
        # The holder removes the file as it lets go: make sure we locked the file that is there now.
        try:
            here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
            same = (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            note = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
            return fd
        os.close(fd)
    raise OutputError(f"cannot lock --out-dir {out_dir}: its lock file keeps changing (another run starting?)")


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
    except OSError:
        return "pid unknown"


def _release(path: Path, fd: int | None) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(path)  # while still locked, so no other run can hold this file meanwhile
    os.close(fd)


@dataclass
class OutputPlan:
    pending: list[Scenario]
    resumed: int = 0
    replaceable: set[str] = field(default_factory=set)  # names under --out-dir this run may replace


def plan_outputs(scenarios: Iterable[Scenario], out_dir: Path, *, decode: bool, overwrite: bool,
                 inputs: frozenset[str] = frozenset()) -> OutputPlan:
    """What this run writes, from results.jsonl (and worker logs) and what is on disk. Raises one
    OutputError listing every file it would replace without leave, and every scenario that
    changed since it was recorded done (both allowed with --overwrite); and every output or
    results log that is one of the run's `inputs` (real paths, `ScenarioFile.input_files`) or a
    log terra did not write (never allowed)."""
    out_dir = Path(out_dir)
    done: dict[str, dict] = {}
    recorded: dict[str, set[str]] = defaultdict(set)
    foreign = []
    for log in results_logs(out_dir):
        records, ours = read_log(log)
        if os.path.realpath(log) in inputs:
            foreign.append(f"{log} is an input of this run")
        elif not ours:
            foreign.append(f"{log} is not a terra results log")
        for record in records:
            key = str(record.get("id"))
            paths = record.get("paths")
            if isinstance(paths, list):
                recorded[key].update(p for p in paths if isinstance(p, str))
            if record.get("status") == "done":
                done[key] = record
    plan = OutputPlan([])
    changed, taken, blocked = [], [], []
    for s in scenarios:
        names = s.output_names(decode)
        last = done.get(s.id)
        if last is not None:
            paths = [p for p in last.get("paths") or [] if isinstance(p, str)]
            if last.get("digest") and s.digest and last["digest"] != s.digest:
                if not overwrite:
                    changed.append(f"{s.id!r} (line {s.line})")
                    continue
            elif set(names) <= set(paths) and all((out_dir / p).is_file() for p in paths):
                plan.resumed += 1
                continue
        plan.pending.append(s)
        for name in names:
            target = out_dir / name
            if target.parent != out_dir and os.path.lexists(target.parent) and not target.parent.is_dir():
                blocked.append(f"{target.parent.relative_to(out_dir)} (line {s.line}) is a file where a folder goes")
                break
            if not os.path.lexists(target):
                continue
            if target.is_dir():
                blocked.append(f"{name} (line {s.line}) is a folder")
            elif os.path.realpath(target) in inputs:
                blocked.append(f"{name} (line {s.line}) is an input of this run")
            elif overwrite or name in recorded[s.id]:
                plan.replaceable.add(name)
            else:
                taken.append(f"{name} (line {s.line})")
    problems = [f"{'; '.join(foreign)}: terra appends a line per scenario to it; move it away or pick another "
                "--out-dir"] if foreign else []
    if blocked:
        problems.append(f"{len(blocked)} output(s) in --out-dir {out_dir} cannot be written: {_some(blocked)}; move "
                        "those away")
    if taken:
        problems.append(f"{len(taken)} file(s) in --out-dir {out_dir} would be replaced, but no terra run recorded "
                        f"them for that scenario in {RESULTS_NAME}: {_some(taken)}; pass --overwrite to replace them")
    if changed:
        problems.append(f"{len(changed)} scenario(s) changed since {out_dir / RESULTS_NAME} recorded them done (same "
                        f"id, other content): {_some(changed)}; pass --overwrite to generate them again")
    if problems:
        raise OutputError("; ".join(problems))
    return plan


def _some(items: list[str], shown: int = 5) -> str:
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
