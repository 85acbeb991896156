"""Scenario files: what `terra generate --scenarios FILE` reads, validated before any model loads.

Two formats, one object per line (blank lines and lines starting with '#' are ignored):

- terra's own: {"id": ..., "context": images | a folder | a video | a tokens .npy,
  "actions": preset | file | inline array, "frames"?, "seed"?, "speed"?}
- ACT-Bench's (turingmotors/ACT-Bench): {"sample_id": ..., "context_frames": [image paths],
  "instruction_trajs": [...], ...}; recognised by `sample_id`.

Paths are relative to the scenario file, except ACT-Bench's `context_frames`, which are relative to
the nuScenes dataroot (`--image-root`, as in ACT-Bench's own generate.py).

ACT-Bench's scorer (act_bench/compute_score.py) globs `*.mp4` in one flat folder, takes the sample id
from the trailing `_<digits>` of each file name and scores the last 44 frames, so an ACT-Bench
scenario writes `NUSCENES_ACTION_<id:06>.mp4` of 47 frames (3 context + 44 generated) by default,
the names and length Terra's own script uses. With --rollouts N the samples go to `s0/`, `s1/`, ...,
each a folder the scorer can read. Every line is checked and every problem is collected
with its line number, so the user fixes them all at once, and two lines that would write the
same file (sample_id 1 and "01", or names that differ only in case) are refused.

Each scenario carries a digest of its normalised content (defaults applied, actions resolved):
results.jsonl records it, so a re-run notices a line that changed but kept its id.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from terra_cli.actions import PRESETS, ActionsError, normalize_actions, instruction_trajs_to_actions, resolve_actions
from terra_cli.backends.base import MAX_SEED
from terra_cli.errors import InputError
from terra_cli.pipeline import inputs
from terra_cli.pipeline.rounds import MAX_TOTAL_FRAMES
from terra_cli.scenarios.contexts import check_images, check_regular_file, check_token_values, check_tokens_file

TOKENS_SUFFIX = ".npy"
TERRA_FRAMES = 25
ACT_BENCH_FRAMES = 47
ACT_BENCH_SAMPLES = 2286  # the benchmark's size (the benches project their rates to it)
ACT_BENCH_PREFIX = "NUSCENES_ACTION_"
# Scenario ids become file names: keep them portable (fullmatch: `$` would let a trailing newline in).
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,150}")
# A line longer than this is not a scenario (an ACT-Bench line is about 120 kB); checked before parsing.
MAX_LINE_CHARS = 4 * 2**20


@dataclass(frozen=True)
class Defaults:
    """What a line does not say, from the command line."""

    frames: int | None = None  # None: 25 for terra lines, 47 for ACT-Bench lines
    seed: int = 0
    speed_kmh: float = 30.0
    context_frames: int = inputs.DEFAULT_CONTEXT_FRAMES
    image_root: Path | None = None  # where ACT-Bench's context_frames live (default: the file's folder)


@dataclass(frozen=True)
class Scenario:
    """One video to generate. Context is images (paths), or tokens (a .npy path), or neither (the
    embedded sample road); actions are already resolved to (F, 6, 3) float32."""

    id: str
    line: int
    actions: np.ndarray
    frames: int
    seed: int
    context_images: tuple[Path, ...] = ()
    context_tokens: Path | None = None
    context_frames: int = inputs.DEFAULT_CONTEXT_FRAMES
    source_format: str = "terra"  # or "act-bench"
    stem: str = ""  # output path without suffix, relative to --out-dir; "" means the id
    digest: str = ""  # of the normalised content (`content_digest`), recorded in results.jsonl
    actions_file: Path | None = None  # where the actions were read from, if a file

    @property
    def output_stem(self) -> str:
        return self.stem or self.id

    def sample(self, index: int) -> "Scenario":
        """The index-th seeded sample of this scene: seed + index, id suffixed `_s{index}`. An
        ACT-Bench sample keeps its scorer-readable file name, in folder `s{index}/`."""
        stem = f"s{index}/{self.output_stem}" if self.source_format == "act-bench" else ""
        digest = "sha256:" + hashlib.sha256(f"{self.digest} sample {index}".encode()).hexdigest()
        return replace(self, id=f"{self.id}_s{index}", seed=self.seed + index, stem=stem, digest=digest)

    def output_names(self, decode: bool) -> list[str]:
        """The files this scenario writes under --out-dir (what results.jsonl's `paths` lists)."""
        return [f"{self.output_stem}.mp4", f"{self.output_stem}.npy"] if decode else [f"{self.output_stem}.npy"]


def content_digest(scenario: Scenario, context=None) -> str:
    """sha256 of what decides a scenario's video: id, output name, frames, seed, the context as the
    line names it (`context`; relative paths, so the same file read from another folder matches)
    and how many of its frames, and the resolved actions the frames use (so presets, speed and
    action files are covered). Context files are named, not hashed."""
    used = np.ascontiguousarray(scenario.actions[: max(scenario.frames - 1, 0)], dtype=np.float32)
    fields = {"id": scenario.id, "stem": scenario.output_stem, "frames": scenario.frames, "seed": scenario.seed,
              "format": scenario.source_format, "context_frames": scenario.context_frames, "context": context,
              "actions": hashlib.sha256(used.tobytes()).hexdigest()}
    return "sha256:" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Problem:
    line: int
    message: str
    id: str | None = None  # the line's id where it could be read, for results.jsonl's skipped record

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class ScenarioFile:
    path: Path
    scenarios: list[Scenario]
    problems: list[Problem]
    source_format: str

    def input_files(self) -> frozenset[str]:
        """Real paths of the files this run reads (the scenario file, contexts, action files): no
        output may replace one, --overwrite or not."""
        paths = [self.path]
        for s in self.scenarios:
            paths += [*s.context_images, s.context_tokens, s.actions_file]
        return frozenset(os.path.realpath(p) for p in paths if p is not None and os.path.isfile(p))


def read_scenarios(path: Path, defaults: Defaults = Defaults(), rollouts: int = 1) -> ScenarioFile:
    """Parse and validate every line; `rollouts` > 1 expands each scenario into seeded samples."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"--scenarios {path} does not exist (give a .jsonl file, one scenario per line)")
    try:
        check_regular_file(path, "--scenarios")
    except InputError as exc:
        raise InputError(f"{exc} (a .jsonl file, one scenario per line)") from None
    if rollouts < 1:
        raise InputError(f"--rollouts must be at least 1, got {rollouts}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read --scenarios {path}: {exc}") from exc
    base = path.parent
    scenarios: list[Scenario] = []
    problems: list[Problem] = []
    formats: set[str] = set()
    first_line_of: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        try:
            scenario = _parse_line(text, number, base, defaults, rollouts)
        except (InputError, ActionsError) as exc:
            problems.append(Problem(number, " ".join(str(exc).split()), _readable_id(text)))
            continue
        formats.add(scenario.source_format)
        if scenario.id in first_line_of:
            problems.append(Problem(number, f"duplicate id {scenario.id!r} (first on line {first_line_of[scenario.id]})",
                                    scenario.id))
            continue
        first_line_of[scenario.id] = number
        scenarios.append(scenario)
    if not scenarios and not problems:
        raise InputError(f"--scenarios {path} holds no scenarios")
    if rollouts > 1:
        scenarios = [s.sample(i) for s in scenarios for i in range(rollouts)]
    scenarios = _refuse_shared_files(scenarios, problems)
    problems.sort(key=lambda p: p.line)
    fmt = formats.pop() if len(formats) == 1 else ("mixed" if formats else "terra")
    return ScenarioFile(path, scenarios, problems, fmt)


def check_context_tokens(file: ScenarioFile, image_tokens: int, image_vocab: int) -> ScenarioFile:
    """Token contexts against the model's layout (its config, before its weights load): a bad
    line becomes a problem with its line number, like every other check."""
    problems = list(file.problems)
    bad_lines: set[int] = set()
    checked: set[int] = set()
    for s in file.scenarios:
        if s.context_tokens is None or s.line in checked:
            continue
        checked.add(s.line)
        try:
            check_token_values(s.context_tokens, s.context_frames, image_tokens, image_vocab)
        except InputError as exc:
            bad_lines.add(s.line)
            problems.append(Problem(s.line, " ".join(str(exc).split()), s.id))
    if not bad_lines:
        return file
    problems.sort(key=lambda p: p.line)
    return replace(file, scenarios=[s for s in file.scenarios if s.line not in bad_lines], problems=problems)


def _parse_line(text: str, number: int, base: Path, defaults: Defaults, rollouts: int) -> Scenario:
    if len(text) > MAX_LINE_CHARS:
        raise InputError(f"the line is {len(text)} characters long; a scenario is at most {MAX_LINE_CHARS}")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise InputError("not a scenario: the JSON is nested too deeply") from None
    except ValueError as exc:  # Python refuses integers of more than 4300 digits
        why = "a number has too many digits" if "digits" in str(exc) else " ".join(str(exc).split())[:120]
        raise InputError(f"not JSON terra can read: {why}") from None
    if not isinstance(record, dict):
        raise InputError(f"expected a JSON object, got {type(record).__name__}")
    try:
        scenario = parse_record(record, number, base, defaults)
    except RecursionError:
        raise InputError("a value is nested too deeply") from None
    if scenario.seed + rollouts - 1 > MAX_SEED:
        raise InputError(f"'seed' {scenario.seed} + {rollouts} rollout(s) - 1 is above the maximum seed {MAX_SEED}")
    context = record.get("context_frames" if scenario.source_format == "act-bench" else "context")
    return replace(scenario, digest=content_digest(scenario, context))


def _readable_id(text: str) -> str | None:  # a bad line's id, if valid, for the record of its skip
    try:
        record = json.loads(text) if len(text) <= MAX_LINE_CHARS else None
        return _check_id(record.get("id", record.get("sample_id"))) if isinstance(record, dict) else None
    except (InputError, ValueError, RecursionError):
        return None


def _refuse_shared_files(scenarios: list[Scenario], problems: list[Problem]) -> list[Scenario]:
    """Two scenarios may not write one file: equal output names, or names equal but for case
    (one file on macOS and Windows file systems). The later line is the problem."""
    first: dict[str, Scenario] = {}
    bad_lines: set[int] = set()
    for s in scenarios:
        key = s.output_stem.casefold()
        other = first.setdefault(key, s)
        if other is not s and other.line != s.line and s.line not in bad_lines:
            bad_lines.add(s.line)
            same = "is" if other.output_stem == s.output_stem else "differs only in case from"
            problems.append(Problem(s.line, f"id {s.id!r} writes {s.output_stem}.*, which {same} the output of id "
                                            f"{other.id!r} on line {other.line}; give the scenarios distinct ids", s.id))
    return [s for s in scenarios if s.line not in bad_lines]


def parse_record(record: dict, line: int, base: Path, defaults: Defaults) -> Scenario:
    if "sample_id" in record:
        return _parse_act_bench(record, line, base, defaults)
    return _parse_terra(record, line, base, defaults)


def _check_id(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"id must be a string or an integer, got {_short(value)}")
    text = str(value)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise InputError(f"id {_short(text)} holds a control character (a newline, a tab, ...); ids name the output files")
    if not _SAFE_ID.fullmatch(text):
        raise InputError(f"id {_short(text)} must be 1 to 151 letters, digits, '.', '_' or '-', starting with a letter "
                         "or digit (it names the output files)")
    return text


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_field(record: dict, key: str, default: int, minimum: int | None = None, maximum: int | None = None) -> int:
    value = record.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{key!r} must be an integer, got {_short(value)}")
    if minimum is not None and value < minimum:
        raise InputError(f"{key!r} must be at least {minimum}, got {_short(value)}")
    if maximum is not None and value > maximum:
        raise InputError(f"{key!r} must be at most {maximum}, got {_short(value)}")
    return value


def _finite_actions(actions: np.ndarray, frames: int) -> np.ndarray:
    """The rows `frames` frames use, as float32, finite after the cast (1e39 is inf in float32)."""
    used = np.asarray(actions[: max(frames - 1, 1)], dtype=np.float32)
    if not np.isfinite(used).all():
        raise InputError("actions hold NaN, inf, or values too large for float32 (above about 3.4e38)")
    return used


def _parse_terra(record: dict, line: int, base: Path, defaults: Defaults) -> Scenario:
    unknown = set(record) - {"id", "context", "actions", "frames", "seed", "speed", "context_frames"}
    if unknown:
        raise InputError(f"unknown key(s) {', '.join(sorted(unknown))}; terra scenarios take id, context, actions, "
                         "frames, seed, speed, context_frames")
    if "id" not in record:
        raise InputError("missing 'id'")
    scenario_id = _check_id(record["id"])
    if "actions" not in record:
        raise InputError("missing 'actions' (a preset, a file, or an inline (frames, 6, 3) array)")
    frames = _int_field(record, "frames", defaults.frames or TERRA_FRAMES, 2, MAX_TOTAL_FRAMES)
    seed = _int_field(record, "seed", defaults.seed, 0, MAX_SEED)
    count = _int_field(record, "context_frames", defaults.context_frames, 1, MAX_TOTAL_FRAMES)
    speed = record.get("speed", defaults.speed_kmh)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not np.isfinite(speed) or speed < 0:
        raise InputError(f"'speed' must be a number of km/h >= 0, got {speed!r}")
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf, which is refused next
        resolved, actions_file = _resolve_actions(record["actions"], frames, float(speed), base)
        actions = _finite_actions(resolved, frames)
    images, tokens = _resolve_context(record.get("context"), base)
    if tokens is not None:
        count = check_tokens_file(tokens, count)
    elif images:
        count = check_images(images, count)
    inputs.check_frame_count(frames, count)
    inputs.check_actions_cover(actions, frames)
    return Scenario(scenario_id, line, actions, frames, seed, tuple(images), tokens, count, "terra",
                    actions_file=actions_file)


def _resolve_actions(value, frames: int, speed: float, base: Path) -> tuple[np.ndarray, Path | None]:
    """The actions, and the file they were read from (None: a preset or inline)."""
    if isinstance(value, str):
        if value.strip().lower() in PRESETS:
            return resolve_actions(value, frames=frames, speed_kmh=speed), None
        path = base / value
        if not path.exists():
            raise InputError(f"actions {_short(value)} is neither a preset ({', '.join(PRESETS)}) nor an existing file "
                             f"(paths are relative to the scenario file)")
        check_regular_file(path, "actions file")
        return resolve_actions(str(path), frames=frames, speed_kmh=speed), path
    if isinstance(value, list):
        if len(value) > MAX_TOTAL_FRAMES * 6:  # (frames, 6, 3) or (frames * 6, 3): refused before converting
            raise InputError(f"inline 'actions' have {len(value)} rows; a scenario takes at most {MAX_TOTAL_FRAMES} frames")
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InputError("inline 'actions' must be numbers of shape (frames, 6, 3)") from exc
        actions = normalize_actions(array, "inline actions")
        if actions.shape[0] > MAX_TOTAL_FRAMES:
            raise InputError(f"inline 'actions' have {actions.shape[0]} frames; a scenario takes at most {MAX_TOTAL_FRAMES}")
        return actions, None
    raise InputError(f"'actions' must be a preset, a file path or an array, got {type(value).__name__}")


def _resolve_context(value, base: Path, relative_to: str = "the scenario file") -> tuple[list[Path], Path | None]:
    """Context paths: one tokens .npy, or images / folders / videos (read later, in order)."""
    if value is None:
        return [], None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise InputError("'context' must be a path or a list of paths (images, a folder, a video, or a tokens .npy)")
    paths = [base / v for v in items]
    missing = [str(v) for v, p in zip(items, paths) if not p.exists()]
    if missing:
        raise InputError(f"context file(s) not found: {', '.join(missing)} (paths are relative to {relative_to})")
    if any(p.suffix.lower() == TOKENS_SUFFIX for p in paths):
        if len(paths) != 1:
            raise InputError("a tokens .npy context must be the only context entry")
        return [], paths[0]
    return paths, None


def _parse_act_bench(record: dict, line: int, base: Path, defaults: Defaults) -> Scenario:
    sample_id = record["sample_id"]
    scenario_id = _check_id(sample_id)
    if "instruction_trajs" not in record:
        raise InputError("ACT-Bench sample without 'instruction_trajs'")
    frames_value = record.get("context_frames")
    if not isinstance(frames_value, list) or not frames_value or not all(isinstance(v, str) for v in frames_value):
        raise InputError("ACT-Bench 'context_frames' must be a non-empty list of image paths")
    frames = defaults.frames or ACT_BENCH_FRAMES
    actions = _finite_actions(instruction_trajs_to_actions(record["instruction_trajs"], "instruction_trajs"), frames)
    root = defaults.image_root or base
    where = f"--image-root {root}" if defaults.image_root else "the scenario file's folder; pass --image-root DATAROOT"
    images, _ = _resolve_context(frames_value, root, relative_to=where)
    count = check_images(images, len(images))
    if actions.shape[0] < frames - 1:
        raise InputError(f"'instruction_trajs' has {actions.shape[0]} rows; {frames} frames need at least {frames - 1} "
                         f"(pass a smaller --frames)")
    inputs.check_frame_count(frames, count)
    inputs.check_actions_cover(actions, frames)
    seed = _int_field(record, "seed", defaults.seed, 0, MAX_SEED)
    return Scenario(scenario_id, line, actions, frames, seed, tuple(images), None, count, "act-bench",
                    stem=act_bench_stem(sample_id))


def act_bench_stem(sample_id) -> str:
    """The file name ACT-Bench's scorer reads the sample id back from (`_(\\d+)$`); ids that are not
    numbers keep their own name, which that scorer cannot read (terra's own tools can)."""
    text = str(sample_id)
    return f"{ACT_BENCH_PREFIX}{int(text):06d}" if text.isdigit() else text


def report(problems: list[Problem], path: Path) -> str:
    """All problems, one per line, for the user to fix at once."""
    head = f"{path}: {len(problems)} invalid scenario line(s):"
    return "\n".join([head, *(f"  {p}" for p in problems)])
