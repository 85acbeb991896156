"""`terra bench --draft-acceptance`: how often would a draft copied from the previous frame be
accepted? Teacher-forced, on true frames, with the reference model.

Under standard speculative sampling a one-hot draft token d at a position is accepted with the
probability the target gives it, p(d) (at temperature 0: 1 if d is the argmax, else 0). The draft
here is the previous frame's token at the same grid position, known before the frame starts. From
the per-position acceptances a_j of the true video we report the mean, its 18x32 map, how often
the true frame repeats the previous one, and the expected tokens per verification step for
k = 1..16 drafts: 1 + sum_{j=1..k} prod_{m<=j} a_m, over every start position of a frame (a step
never spans a frame: the action slots in between are prompt tokens), next to the i.i.d.
approximation (1 - a^(k+1)) / (1 - a).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_DRAFT = 16


@dataclass(frozen=True)
class AcceptancePlan:
    seeds: int = 3
    frames: int = 8
    presets: tuple[str, ...] = ("left", "right", "straight")
    temperatures: tuple[float, ...] = (0.9, 0.0)
    speed_kmh: float = 30.0
    first_world_seed: int = 1000  # held out, as in `terra eval`


def acceptance(logits: np.ndarray, drafts: np.ndarray, temperature: float) -> np.ndarray:
    """logits (..., V) over image codes, drafts (...) int -> the probability each draft is accepted."""
    logits = np.asarray(logits, dtype=np.float64)
    picked = np.take_along_axis(logits, drafts[..., None], axis=-1)[..., 0]
    if temperature == 0:
        return (picked >= logits.max(axis=-1)).astype(np.float64)
    scaled = logits / temperature
    shift = scaled.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(scaled - shift).sum(axis=-1)) + shift[..., 0]
    return np.exp(picked / temperature - log_norm)


def expected_tokens_per_step(accept: np.ndarray, k: int) -> float:
    """accept (frames, T): mean over start positions i of 1 + sum_{j=1..k} prod_{m=0..j-1} a[i+m],
    windows cut at the frame's end."""
    frames, tokens = accept.shape
    total = 0.0
    for f in range(frames):
        row = accept[f]
        for i in range(tokens):
            prefix, run = 1.0, 1.0
            for m in range(i, min(i + k, tokens)):
                run *= row[m]
                prefix += run
            total += prefix
    return total / (frames * tokens)


def iid_tokens_per_step(a: float, k: int) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def teacher_forced_image_logits(model, tokens: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """tokens (F, T), actions (>= F, 6, 3) -> logits (F-1, T, V_img) predicting frames 1..F-1."""
    import torch

    layout = model.layout
    frames = tokens.shape[0]
    device = model.lm_head.weight.device
    slots = np.full((frames, layout.action_tokens), layout.action_placeholder_id)
    ids = torch.tensor(np.concatenate([tokens, slots], axis=1).reshape(1, -1), device=device)
    positions = torch.arange(ids.shape[1], device=device)[None]
    waypoints = torch.from_numpy(np.ascontiguousarray(actions[:frames], dtype=np.float32)).reshape(1, -1, 3).to(device)
    with torch.inference_mode():
        logits, _ = model(ids, positions, waypoints)
    logits = logits[0, :, : layout.image_vocab_size].float().cpu().numpy()
    stride = layout.frame_stride
    # Position p's logits predict token p + 1: frame f's code i comes from index f*stride + i - 1.
    return np.stack([logits[f * stride - 1 : f * stride - 1 + layout.image_tokens] for f in range(1, frames)])


def run_draft_acceptance(model, tokenizer, plan: AcceptancePlan, log=lambda msg: None) -> dict:
    from terra_cli.actions import preset_actions
    from terra_cli.synthetic.dataset import render_rollout

    per_temperature = {t: [] for t in plan.temperatures}
    repeats = []
    for preset in plan.presets:
        for s in range(plan.seeds):
            seed = plan.first_world_seed + s
            actions = preset_actions(preset, plan.frames, plan.speed_kmh)
            tokens = tokenizer.tokenize(list(render_rollout(seed, actions)))
            logits = teacher_forced_image_logits(model, tokens, actions)
            drafts, truth = tokens[:-1], tokens[1:]
            repeats.append(float((drafts == truth).mean()))
            for t in plan.temperatures:
                per_temperature[t].append(acceptance(logits, drafts, t))
            log(f"{preset} world {seed}: repeat {repeats[-1]:.3f}")
    layout = model.layout
    grid = (layout.image_tokens // 32, 32) if layout.image_tokens % 32 == 0 else (1, layout.image_tokens)
    results = {"plan": {**plan.__dict__, "presets": list(plan.presets), "temperatures": list(plan.temperatures)},
               "true_next_frame_repeats_previous": round(float(np.mean(repeats)), 4), "temperatures": {}}
    for t, chunks in per_temperature.items():
        accept = np.concatenate(chunks)  # (rollouts * (frames - 1), T)
        mean = float(accept.mean())
        results["temperatures"][str(t)] = {
            "mean_acceptance": round(mean, 4),
            "acceptance_grid": np.round(accept.mean(axis=0).reshape(grid), 4).tolist(),
            "tokens_per_step": {k: round(expected_tokens_per_step(accept, k), 3) for k in range(1, MAX_DRAFT + 1)},
            "tokens_per_step_iid": {k: round(iid_tokens_per_step(mean, k), 3) for k in range(1, MAX_DRAFT + 1)},
        }
    return results


def plot_heatmaps(results: dict, path, overwrite: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from terra_cli.media.atomic import save_figure

    temps = list(results["temperatures"])
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 3.2), squeeze=False)
    for ax, t in zip(axes[0], temps):
        data = results["temperatures"][t]
        im = ax.imshow(np.array(data["acceptance_grid"]), vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"T={t}: mean acceptance {data['mean_acceptance']:.3f}", fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.03)
    fig.suptitle("previous-frame draft: acceptance per grid position", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, overwrite)
    plt.close(fig)
