"""`terra eval`: how well a world model predicts terra's synthetic road world, as plain functions.

For every preset (left, right, straight, ...) and every seed s = 0..N-1 the synthetic world renders
the ground truth: world `EVAL_WORLD_SEED_BASE + s` (1000, 1001, ...), ego starting at arc length 0
in the world's ego lane, driving the preset at `speed_kmh`. The first K frames are tokenized as the
context; the world model generates the remaining frames under the same actions (all seeds of a
preset in one batched `generate` call); the tokens are decoded and compared with the true frames.

Held out: the training scripts draw a world seed per rollout at random from [0, 2**31 - 1)
(`synthetic.dataset.rollout_spec`, data seed 0 for the tokenizer, data seed 1 for the world model),
not from a small range; `training_world_seeds` recomputes them and the tests check that none falls
in the evaluation range (start poses and action sequences differ from training too).

Metrics, per generated frame j = 1..F-K (j counts from the last context frame):
* PSNR / SSIM of the decoded generated frame vs the true frame;
* the copy baseline: the last true context frame vs the true frame j (a model that predicts
  "nothing changes");
* the tokenizer ceiling: PSNR of the tokenizer's own reconstruction of the true frame j (what a
  perfect token prediction would score), on the first `ceiling_seeds` seeds only (the tokenizer
  takes ~0.8 s per frame each way on a 2-core CPU);
* action following: the apparent lateral motion (m, + left) from the last context frame to the last
  generated frame, summed over consecutive frames with `estimate_lateral_motion` on the generated
  frames (the last context frame as the tokenizer reconstructs it, then the generated frames). The
  same estimate on the true frames and the commanded lateral offset (from the action waypoints)
  are reported beside it; for left/right, the fraction of seeds whose estimated sign is right.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from terra_cli.backends.base import Sampling
from terra_cli.errors import TerraError
from terra_cli.evaluation.metrics import (clean, commanded_lateral, copy_baseline, finite_mean, lateral_from_last_context,
                                          per_frame_psnr, per_frame_ssim, sign_accuracy)

EVAL_WORLD_SEED_BASE = 1000
# Caps checked before anything is rendered: a preset's rollouts are held in memory together
# (4000 frames of 288x512 RGB are 1.8 GB).
MAX_EVAL_FRAMES = 100
MAX_EVAL_SEED_FRAMES = 4000
SUMMARY_FRAMES = 5  # summary PSNR averages generated frames 1..5 (fewer when fewer are generated)
EXPECTED_SIGN = {"left": 1.0, "right": -1.0}
TRAINING_DATA_SEEDS = (0, 1)  # scripts/train/train_tokenizer.py, scripts/train/train_world_model.py (--data-seed defaults)


class EvalError(TerraError):
    """Options of `terra eval` that cannot be evaluated."""


@dataclass
class EvalPlan:
    presets: list[str] = field(default_factory=lambda: ["left", "right", "straight"])
    seeds: int = 20
    context_frames: int = 3
    frames: int = 8
    speed_kmh: float = 30.0
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=0.0))  # greedy: deterministic
    world_seed_base: int = EVAL_WORLD_SEED_BASE
    ceiling_seeds: int = 4  # the tokenizer ceiling is measured on the first few seeds (encode+decode is slow on CPU)

    def validate(self) -> None:
        from terra_cli.actions import PRESETS

        if not self.presets:
            raise EvalError("--presets needs at least one preset")
        unknown = [p for p in self.presets if p not in PRESETS]
        if unknown:
            raise EvalError(f"unknown preset {unknown[0]!r}; choose from {', '.join(PRESETS)}")
        if len(set(self.presets)) != len(self.presets):
            raise EvalError(f"--presets lists a preset twice: {','.join(self.presets)}")
        if self.seeds < 1:
            raise EvalError(f"--seeds must be at least 1, got {self.seeds}")
        if self.context_frames < 1:
            raise EvalError(f"--context-frames must be at least 1, got {self.context_frames}")
        if self.frames <= self.context_frames:
            raise EvalError(f"--frames ({self.frames}) must be more than --context-frames ({self.context_frames})")
        if self.ceiling_seeds < 0:
            raise EvalError(f"--ceiling-seeds must be >= 0, got {self.ceiling_seeds}")
        if not 0 < self.speed_kmh <= 200:
            raise EvalError(f"--speed must be in (0, 200] km/h, got {self.speed_kmh}")
        if self.frames > MAX_EVAL_FRAMES:
            raise EvalError(f"--frames {self.frames} is above the maximum of {MAX_EVAL_FRAMES}: eval runs one round "
                            "of the model (Terra's is 25 frames)")
        if self.seeds * self.frames > MAX_EVAL_SEED_FRAMES:
            raise EvalError(f"--seeds {self.seeds} x --frames {self.frames} is above the maximum of "
                            f"{MAX_EVAL_SEED_FRAMES} frames per preset (every seed's frames are held in memory)")

    def check_model(self, max_frames: int) -> None:
        """Once the model's config is read, before anything is rendered: eval runs one round."""
        if self.frames > max_frames:
            raise EvalError(f"--frames {self.frames} is above this model's {max_frames} frames per round "
                            "(eval does not re-seed in rounds)")

    @property
    def generated_frames(self) -> int:
        return self.frames - self.context_frames

    def world_seeds(self) -> list[int]:
        return [self.world_seed_base + s for s in range(self.seeds)]


def parse_presets(text: str) -> list[str]:
    return [p.strip().lower() for p in text.split(",") if p.strip()]


# --------------------------------------------------------------------------------------------
# Metrics (pure functions, unit-tested)


def training_world_seeds(data_seed: int, n_rollouts: int) -> set[int]:
    """World seeds of the first `n_rollouts` rollouts of a training data seed (as `rollout_spec` draws them)."""
    from terra_cli.synthetic.camera import _rng

    return {int(_rng(0xDA7A, data_seed, i).integers(0, 2**31 - 1)) for i in range(n_rollouts)}


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class PresetResult:
    """Arrays over (seeds, generated frames) and (seeds,) for one preset."""

    name: str
    world_seeds: list[int]
    psnr_generated: np.ndarray
    psnr_copy: np.ndarray
    ssim_generated: np.ndarray
    ssim_copy: np.ndarray
    psnr_tokenizer: np.ndarray
    lateral_generated: np.ndarray
    lateral_true: np.ndarray
    lateral_commanded: float
    seconds_generate: float
    seconds_total: float
    strip_true: np.ndarray = None  # (K-last + generated, H, W, 3) of the first seed, for the strip picture
    strip_generated: np.ndarray = None

    def summary(self, summary_frames: int) -> dict:
        n = min(summary_frames, self.psnr_generated.shape[1])
        out = {
            "psnr_generated": finite_mean(self.psnr_generated[:, :n]),
            "psnr_copy_baseline": finite_mean(self.psnr_copy[:, :n]),
            "ssim_generated": finite_mean(self.ssim_generated[:, :n]),
            "ssim_copy_baseline": finite_mean(self.ssim_copy[:, :n]),
            "psnr_tokenizer_ceiling": finite_mean(self.psnr_tokenizer[:, :n]),
            "lateral_generated_mean_m": finite_mean(self.lateral_generated),
            "lateral_generated_std_m": float(np.std(self.lateral_generated)),
            "lateral_true_mean_m": finite_mean(self.lateral_true),
            "lateral_commanded_m": self.lateral_commanded,
        }
        if self.name in EXPECTED_SIGN:
            out["sign_accuracy"] = sign_accuracy(self.lateral_generated, EXPECTED_SIGN[self.name])
            out["sign_accuracy_true_frames"] = sign_accuracy(self.lateral_true, EXPECTED_SIGN[self.name])
        else:
            out["abs_lateral_generated_mean_m"] = finite_mean(np.abs(self.lateral_generated))
            out["abs_lateral_true_mean_m"] = finite_mean(np.abs(self.lateral_true))
        return out

    def to_json(self, summary_frames: int) -> dict:
        g = self.psnr_generated.shape[1]
        return {
            "per_frame": {
                "frame_index": list(range(1, g + 1)),
                "psnr_generated": [finite_mean(c) for c in self.psnr_generated.T],
                "psnr_copy_baseline": [finite_mean(c) for c in self.psnr_copy.T],
                "ssim_generated": [finite_mean(c) for c in self.ssim_generated.T],
                "ssim_copy_baseline": [finite_mean(c) for c in self.ssim_copy.T],
                "psnr_tokenizer_ceiling": [finite_mean(c) for c in self.psnr_tokenizer.T],
            },
            "per_seed": [
                {
                    "seed": i,
                    "world_seed": ws,
                    "psnr_generated": self.psnr_generated[i],
                    "psnr_copy_baseline": self.psnr_copy[i],
                    "ssim_generated": self.ssim_generated[i],
                    "ssim_copy_baseline": self.ssim_copy[i],
                    "psnr_tokenizer_ceiling": self.psnr_tokenizer[i],
                    "lateral_generated_m": self.lateral_generated[i],
                    "lateral_true_m": self.lateral_true[i],
                }
                for i, ws in enumerate(self.world_seeds)
            ],
            "summary": self.summary(summary_frames),
            "seconds": {"generate": self.seconds_generate, "total": self.seconds_total},
        }


def evaluate_preset(
    name: str,
    plan: EvalPlan,
    tokenizer,
    backend,
    *,
    on_frame: Callable[[int, np.ndarray], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> PresetResult:
    """Render, tokenize, generate (all seeds in one call), decode and score one preset."""
    from terra_cli.actions import preset_actions
    from terra_cli.synthetic.dataset import render_rollout

    stage = on_stage or (lambda _msg: None)
    started = time.perf_counter()
    K, F, G = plan.context_frames, plan.frames, plan.generated_frames
    R = plan.seeds
    actions = preset_actions(name, F, plan.speed_kmh)
    world_seeds = plan.world_seeds()

    stage(f"{name}: rendering {R} true rollouts")
    truth = np.stack([render_rollout(ws, actions) for ws in world_seeds])  # (R, F, H, W, 3)

    C = min(plan.ceiling_seeds, R)
    H, W = truth.shape[2:4]
    stage(f"{name}: tokenizing {R * K + C * G} true frames")
    images = list(truth[:, :K].reshape(R * K, H, W, 3)) + list(truth[:C, K:].reshape(C * G, H, W, 3))
    all_tokens = tokenizer.tokenize(images)
    T = all_tokens.shape[-1]
    context = all_tokens[: R * K].reshape(R, K, T)
    target_tokens = all_tokens[R * K:].reshape(C, G, T)  # explicit T: C may be 0

    stage(f"{name}: generating {G} frame(s) x {R} rollout(s)")
    t0 = time.perf_counter()
    tokens = backend.generate(context, np.broadcast_to(actions, (R, *actions.shape)), F, plan.sampling,
                              on_frame=on_frame)
    seconds_generate = time.perf_counter() - t0
    tokens = np.asarray(tokens)
    if tokens.shape[:2] != (R, F):
        raise EvalError(f"the world model returned tokens of shape {tokens.shape}, expected ({R}, {F}, ...)")

    stage(f"{name}: decoding and scoring")
    # Decode the generated frames, the last context frame of every seed, the true frames of the ceiling seeds.
    decoded = tokenizer.decode_tokens(np.concatenate([
        tokens[:, K:].reshape(R * G, T), context[:, K - 1], target_tokens.reshape(C * G, T)]))
    generated = decoded[: R * G].reshape(R, G, H, W, 3)
    recon_last = decoded[R * G: R * G + R]
    recon_target = decoded[R * G + R:].reshape(C, G, H, W, 3)

    psnr_gen = np.empty((R, G))
    psnr_copy = np.empty((R, G))
    ssim_gen = np.empty((R, G))
    ssim_copy = np.empty((R, G))
    psnr_tok = np.full((R, G), np.nan)
    lat_gen = np.empty(R)
    lat_true = np.empty(R)
    for r in range(R):
        target = truth[r, K:]
        last = truth[r, K - 1]
        copy = copy_baseline(last, target)
        psnr_gen[r] = per_frame_psnr(generated[r], target)
        psnr_copy[r] = per_frame_psnr(copy, target)
        ssim_gen[r] = per_frame_ssim(generated[r], target)
        ssim_copy[r] = per_frame_ssim(copy, target)
        if r < C:
            psnr_tok[r] = per_frame_psnr(recon_target[r], target)
        lat_gen[r] = lateral_from_last_context(recon_last[r], generated[r])
        lat_true[r] = lateral_from_last_context(last, target)
    return PresetResult(
        name=name,
        world_seeds=world_seeds,
        psnr_generated=psnr_gen,
        psnr_copy=psnr_copy,
        ssim_generated=ssim_gen,
        ssim_copy=ssim_copy,
        psnr_tokenizer=psnr_tok,
        lateral_generated=lat_gen,
        lateral_true=lat_true,
        lateral_commanded=commanded_lateral(actions, K, F),
        seconds_generate=seconds_generate,
        seconds_total=time.perf_counter() - started,
        strip_true=truth[0, K - 1:],
        strip_generated=np.concatenate([recon_last[:1], generated[0]]),
    )


def build_results(plan: EvalPlan, results: list[PresetResult], *, model: str, tokenizer: str, backend: str,
                  device: str, seconds_total: float, seconds_load: float, environment: dict) -> dict:
    n = min(SUMMARY_FRAMES, plan.generated_frames)
    everything = lambda attr: np.concatenate([getattr(r, attr)[:, :n].ravel() for r in results])  # noqa: E731
    summary = {
        "summary_frames": list(range(1, n + 1)),
        "psnr_generated_frames_1_5": finite_mean(everything("psnr_generated")),
        "psnr_copy_baseline_frames_1_5": finite_mean(everything("psnr_copy")),
        "ssim_generated_frames_1_5": finite_mean(everything("ssim_generated")),
        "ssim_copy_baseline_frames_1_5": finite_mean(everything("ssim_copy")),
        "psnr_tokenizer_ceiling_frames_1_5": finite_mean(everything("psnr_tokenizer")),
    }
    by_name = {r.name: r for r in results}
    for name, sign in EXPECTED_SIGN.items():
        if name in by_name:
            summary[f"sign_accuracy_{name}"] = sign_accuracy(by_name[name].lateral_generated, sign)
    if "left" in by_name and "right" in by_name:
        both = np.concatenate([by_name["left"].lateral_generated, -by_name["right"].lateral_generated])
        summary["sign_accuracy_left_right"] = sign_accuracy(both, 1.0)
    if "straight" in by_name:
        summary["abs_lateral_straight_mean_m"] = finite_mean(np.abs(by_name["straight"].lateral_generated))
    config = asdict(plan)
    sampling = config.pop("sampling")  # the report's keys as before the settings became one object
    config.update({"temperature": sampling["temperature"], "top_k": sampling["top_k"], "top_p": sampling["top_p"],
                   "sampling_seed": sampling["seed"]})
    config.update({
        "model": model, "tokenizer": tokenizer, "backend": backend, "device": device,
        "generated_frames": plan.generated_frames, "world_seeds": plan.world_seeds(),
        "sampling": "greedy" if plan.sampling.greedy else f"temperature {plan.sampling.temperature}",
    })
    return clean({
        "config": config,
        "presets": {r.name: r.to_json(SUMMARY_FRAMES) for r in results},
        "summary": summary,
        "seconds": {"total": seconds_total, "load": seconds_load,
                    "generate": sum(r.seconds_generate for r in results)},
        "environment": environment,
    })
