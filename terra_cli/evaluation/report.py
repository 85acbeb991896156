"""`terra eval`'s outputs: the results as JSON, the per-preset plot, the strip of true vs generated
frames, and number formatting for the table."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from terra_cli.evaluation.run import PresetResult

# --------------------------------------------------------------------------------------------
# Outputs


PRESET_COLORS = {"left": "#2a7ab9", "right": "#d0542c", "straight": "#3a9a48", "stop": "#8a4fb0", "accelerate": "#c79a16"}


def save_json(results: dict, path: Path, overwrite: bool = False) -> None:
    import json

    from terra_cli.media.atomic import atomic_path

    with atomic_path(Path(path), overwrite) as tmp:
        tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")


def plot_eval(results: dict, path: Path, overwrite: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from terra_cli.media.atomic import save_figure

    presets = results["presets"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    ceiling = None
    for name, res in presets.items():
        pf = res["per_frame"]
        x = pf["frame_index"]
        col = PRESET_COLORS.get(name, None)
        ax1.plot(x, _nan(pf["psnr_generated"]), "o-", color=col, label=f"{name}: generated")
        ax1.plot(x, _nan(pf["psnr_copy_baseline"]), "s--", color=col, alpha=0.6, label=f"{name}: copy last context")
        ceil = np.array(_nan(pf["psnr_tokenizer_ceiling"]))
        ceiling = ceil if ceiling is None else ceiling + ceil
    if ceiling is not None:
        ax1.plot(x, ceiling / len(presets), "k:", lw=2, label="tokenizer reconstruction (ceiling)")
    ax1.set_xlabel("generated frame (1 = first after the context, 10 Hz)")
    ax1.set_ylabel("PSNR vs true frame (dB)")
    ax1.set_xticks(x)
    ax1.set_title("prediction quality (mean over seeds)")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)

    names = list(presets)
    rng = np.random.default_rng(0)
    for i, name in enumerate(names):
        res = presets[name]
        lat = np.array(_nan([s["lateral_generated_m"] for s in res["per_seed"]]))
        true = np.array(_nan([s["lateral_true_m"] for s in res["per_seed"]]))
        col = PRESET_COLORS.get(name, None)
        jitter = rng.uniform(-0.12, 0.12, size=len(lat))
        ax2.scatter(i + jitter, lat, color=col, s=18, alpha=0.8, label="generated (per seed)" if i == 0 else None)
        ax2.scatter(i + 0.3 + jitter * 0.3, true, color=col, marker="x", s=18, alpha=0.5,
                    label="true frames (per seed)" if i == 0 else None)
        cmd = res["summary"]["lateral_commanded_m"]
        ax2.hlines(cmd, i - 0.25, i + 0.4, color="k", lw=1.5, label="commanded offset (translation only;\nthe estimate also sees the yaw)" if i == 0 else None)
        acc = res["summary"].get("sign_accuracy")
        if acc is not None:
            ax2.annotate(f"sign {acc:.0%}", (i, np.nanmax(np.concatenate([lat, [cmd]]))), textcoords="offset points",
                         xytext=(0, 8), ha="center", fontsize=8)
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xticks(range(len(names)), names)
    ax2.set_ylabel("lateral motion, last context -> last frame (m, + left)")
    ax2.set_title("action following (estimated from lane markings)")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3, axis="y")
    cfg = results["config"]
    s = results["summary"]
    fig.suptitle(
        f"{'/'.join(Path(str(cfg['model'])).parts[-2:])}: {cfg['seeds']} held-out worlds x {len(names)} presets, {cfg['context_frames']} context + "
        f"{cfg['generated_frames']} generated frames, {cfg['sampling']}, {cfg['backend']} | PSNR frames 1-{len(s['summary_frames'])}: "
        f"generated {format_metric(s['psnr_generated_frames_1_5'])} dB vs copy {format_metric(s['psnr_copy_baseline_frames_1_5'])} dB",
        fontsize=9, parse_math=False,  # a model path with $ is not mathtext
    )
    fig.tight_layout()
    save_figure(fig, Path(path), overwrite)
    plt.close(fig)


def strip_image(results: list[PresetResult], max_columns: int = 5, scale: float = 0.5) -> np.ndarray:
    """Rows true / generated of the first seed of each preset: last context frame, then generated frames."""
    from PIL import Image, ImageDraw

    label_w = 96
    rows = []
    for r in results:
        for kind, frames in (("true", r.strip_true), ("generated", r.strip_generated)):
            frames = frames[:max_columns]
            h, w = frames.shape[1:3]
            sw, sh = int(w * scale), int(h * scale)
            row = Image.new("RGB", (label_w + len(frames) * (sw + 2), sh + 2), (255, 255, 255))
            draw = ImageDraw.Draw(row)
            draw.text((4, sh // 2 - 12), f"{r.name}\n{kind}\nworld {r.world_seeds[0]}", fill=(0, 0, 0))
            for j, f in enumerate(frames):
                tile = Image.fromarray(np.ascontiguousarray(f)).resize((sw, sh), Image.BILINEAR)
                x = label_w + j * (sw + 2)
                row.paste(tile, (x, 1))
                label = f"+{j}" if j else ("last context" if kind == "true" else "last context (tokenizer)")
                draw.text((x + 4, 3), label, fill=(255, 255, 0))
            rows.append(np.asarray(row))
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 0), (0, width - r.shape[1]), (0, 0)), constant_values=255) for r in rows]
    return np.concatenate(rows)


def save_strip(results: list[PresetResult], path: Path, overwrite: bool = False) -> None:
    from PIL import Image

    from terra_cli.media.atomic import atomic_path

    with atomic_path(Path(path), overwrite) as tmp:
        Image.fromarray(strip_image(results)).save(tmp, format="PNG")


def _nan(values):
    return [float("nan") if v is None else v for v in values]


def format_metric(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.2f}"
