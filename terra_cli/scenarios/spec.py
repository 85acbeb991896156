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
with its line number, so the user fixes them all at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from terra_cli.actions import PRESETS, ActionsError, normalize_actions, instruction_trajs_to_actions, resolve_actions
from terra_cli.errors import InputError
from terra_cli.pipeline import inputs

TOKENS_SUFFIX = ".npy"
TERRA_FRAMES = 25
ACT_BENCH_FRAMES = 47
ACT_BENCH_PREFIX = "NUSCENES_ACTION_"
# Scenario ids become file names: keep them portable.
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,150}$")


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

    @property
    def output_stem(self) -> str:
        return self.stem or self.id

    def sample(self, index: int) -> "Scenario":
        """The index-th seeded sample of this scene: seed + index, id suffixed `_s{index}`. An
        ACT-Bench sample keeps its scorer-readable file name, in folder `s{index}/`."""
        stem = f"s{index}/{self.output_stem}" if self.source_format == "act-bench" else ""
        return replace(self, id=f"{self.id}_s{index}", seed=self.seed + index, stem=stem)


@dataclass(frozen=True)
class Problem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class ScenarioFile:
    path: Path
    scenarios: list[Scenario]
    problems: list[Problem]
    source_format: str


def read_scenarios(path: Path, defaults: Defaults = Defaults(), rollouts: int = 1) -> ScenarioFile:
    """Parse and validate every line; `rollouts` > 1 expands each scenario into seeded samples."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--scenarios {path} does not exist (give a .jsonl file, one scenario per line)")
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
            record = json.loads(text)
            if not isinstance(record, dict):
                raise InputError(f"expected a JSON object, got {type(record).__name__}")
            scenario = parse_record(record, number, base, defaults)
        except json.JSONDecodeError as exc:
            problems.append(Problem(number, f"not JSON: {exc.msg} at column {exc.colno}"))
            continue
        except (InputError, ActionsError) as exc:
            problems.append(Problem(number, " ".join(str(exc).split())))
            continue
        formats.add(scenario.source_format)
        if scenario.id in first_line_of:
            problems.append(Problem(number, f"duplicate id {scenario.id!r} (first on line {first_line_of[scenario.id]})"))
            continue
        first_line_of[scenario.id] = number
        scenarios.append(scenario)
    if not scenarios and not problems:
        raise InputError(f"--scenarios {path} holds no scenarios")
    if rollouts > 1:
        scenarios = [s.sample(i) for s in scenarios for i in range(rollouts)]
    fmt = formats.pop() if len(formats) == 1 else ("mixed" if formats else "terra")
    return ScenarioFile(path, scenarios, problems, fmt)


def parse_record(record: dict, line: int, base: Path, defaults: Defaults) -> Scenario:
    if "sample_id" in record:
        return _parse_act_bench(record, line, base, defaults)
    return _parse_terra(record, line, base, defaults)


def _check_id(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"id must be a string or an integer, got {value!r}")
    text = str(value)
    if not _SAFE_ID.match(text):
        raise InputError(f"id {text!r} must be letters, digits, '.', '_' or '-' (it names the output files)")
    return text


def _int_field(record: dict, key: str, default: int, minimum: int | None = None) -> int:
    value = record.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{key!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{key!r} must be at least {minimum}, got {value}")
    return value


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
    frames = _int_field(record, "frames", defaults.frames or TERRA_FRAMES, 2)
    seed = _int_field(record, "seed", defaults.seed, 0)
    count = _int_field(record, "context_frames", defaults.context_frames, 1)
    speed = record.get("speed", defaults.speed_kmh)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not np.isfinite(speed) or speed < 0:
        raise InputError(f"'speed' must be a number of km/h >= 0, got {speed!r}")
    actions = _resolve_actions(record["actions"], frames, float(speed), base)
    images, tokens = _resolve_context(record.get("context"), base)
    if tokens is not None:
        count = _check_tokens_file(tokens, count)
    elif images:
        count = _check_images(images, count)
    inputs.check_frame_count(frames, count)
    inputs.check_actions_cover(actions, frames)
    return Scenario(scenario_id, line, actions, frames, seed, tuple(images), tokens, count, "terra")


def _resolve_actions(value, frames: int, speed: float, base: Path) -> np.ndarray:
    if isinstance(value, str):
        if value.strip().lower() in PRESETS:
            return resolve_actions(value, frames=frames, speed_kmh=speed)
        path = base / value
        if not path.exists():
            raise InputError(f"actions {value!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file "
                             f"(paths are relative to the scenario file)")
        return resolve_actions(str(path), frames=frames, speed_kmh=speed)
    if isinstance(value, list):
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InputError("inline 'actions' must be numbers of shape (frames, 6, 3)") from exc
        return normalize_actions(array, "inline actions")
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


def _check_tokens_file(path: Path, count: int) -> int:
    """Header-only check (shape, dtype) of a tokens .npy; returns how many rows will be used."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path.name} as a .npy array: {exc}") from exc
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{path.name}: context tokens must be an int array (frames, 576), got {array.dtype} {array.shape}")
    if array.shape[0] < 1:
        raise InputError(f"{path.name} holds no frames")
    return min(count, array.shape[0])


def _check_images(paths: list[Path], count: int) -> int:
    """Images are opened header-only (size, readable); videos and folders are counted. Returns the
    number of context frames that will be used (the last `count`)."""
    from PIL import Image, UnidentifiedImageError

    from terra_cli.media.frames import count_frames, is_video, list_images

    total = 0
    for path in paths:
        if path.is_dir():
            files = list_images(path)
            if not files:
                raise InputError(f"context folder {path.name} holds no images")
            total += len(files)
        elif is_video(path):
            total += count_frames(path) or 0
        else:
            try:
                with Image.open(path) as image:
                    image.verify()
            except (OSError, UnidentifiedImageError) as exc:
                raise InputError(f"context image {path.name} cannot be read: {exc}") from exc
            total += 1
    if total < 1:
        raise InputError("context holds no frames")
    return min(count, total)


def _parse_act_bench(record: dict, line: int, base: Path, defaults: Defaults) -> Scenario:
    sample_id = record["sample_id"]
    scenario_id = _check_id(sample_id)
    if "instruction_trajs" not in record:
        raise InputError("ACT-Bench sample without 'instruction_trajs'")
    frames_value = record.get("context_frames")
    if not isinstance(frames_value, list) or not frames_value or not all(isinstance(v, str) for v in frames_value):
        raise InputError("ACT-Bench 'context_frames' must be a non-empty list of image paths")
    actions = instruction_trajs_to_actions(record["instruction_trajs"], "instruction_trajs")
    root = defaults.image_root or base
    where = f"--image-root {root}" if defaults.image_root else "the scenario file's folder; pass --image-root DATAROOT"
    images, _ = _resolve_context(frames_value, root, relative_to=where)
    count = _check_images(images, len(images))
    frames = defaults.frames or ACT_BENCH_FRAMES
    if actions.shape[0] < frames - 1:
        raise InputError(f"'instruction_trajs' has {actions.shape[0]} rows; {frames} frames need at least {frames - 1} "
                         f"(pass a smaller --frames)")
    inputs.check_frame_count(frames, count)
    inputs.check_actions_cover(actions, frames)
    seed = _int_field(record, "seed", defaults.seed, 0)
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
