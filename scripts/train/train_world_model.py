#!/usr/bin/env python
"""Train terra-mini's world model: a small LlamaAction decoder over the synthetic world's tokens.

1. Data: seeded rollouts of `terra_cli.synthetic_world` (rendered by a pool of CPU workers) are
   tokenized on the GPU with a trained tokenizer (`scripts/train/train_tokenizer.py`), in batches; the
   tokens (int16) and actions are cached in OUT/data and reused on --resume.
2. Model: `terra_cli.modeling_hf` LlamaAction with Terra's layout (576 image tokens + 6 action slots
   per frame, up to 25 frames), by default 6 layers, hidden 384, 6 heads (head_dim 64), 2 KV heads,
   MLP 1024, vocab = codebook + 1.
3. Objective: next-token cross-entropy on image tokens only: every image-token position and the last
   action slot of every frame predict the next image code; nothing predicts action slots.
   Windows of --seq-frames frames from the rollouts; with fewer than 25 frames a window is placed at a
   random frame offset (position ids), so that every temporal embedding gets trained.
   AdamW, warmup + cosine, bf16 autocast on GPU, gradient clipping.

Stops after --steps or --max-minutes (counted from the start, data included); checkpoints every
--ckpt-every steps to OUT/ckpt/state.pt (--resume continues); logs to stdout and OUT/log.csv; saves
OUT/world_model with `terra_cli.checkpoint.save_checkpoint` (Terra's format; loads strictly with
`terra_cli.modeling_hf.load_model`) in float32 when that fits --max-mb, else bfloat16.

    python scripts/train/train_world_model.py --tokenizer runs/tok/tokenizer --out runs/wm
    python scripts/train/train_world_model.py --tokenizer runs/tok/tokenizer --out runs/wm --resume
    python scripts/train/train_world_model.py --smoke --out /tmp/wm     # CPU, tiny, random tokenizer
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

import _train_common as common
from _train_common import log

IMAGE_TOKENS, ACTION_TOKENS, MAX_FRAMES = 576, 6, 25


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, default=None, help="trained tokenizer directory (config.json + model.safetensors)")
    common.add_run_arguments(p, smoke_help="tiny model and data, 2 steps, CPU; a random tokenizer if none is given",
                             schedule_default="what is left of --max-minutes after the data", lr=1e-3, weight_decay=0.1,
                             val_every=250)
    # model
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--max-mb", type=float, default=20.0,
                   help="save in float32 if the weights fit in this many MiB, else bfloat16")
    # optimisation
    p.add_argument("--seq-frames", type=int, default=25, help="frames per training window (<= 25)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per step")
    p.add_argument("--grad-accum", type=int, default=1)
    # data
    p.add_argument("--data-seed", type=int, default=1)
    p.add_argument("--n-rollouts", type=int, default=2000)
    p.add_argument("--rollout-frames", type=int, default=25)
    p.add_argument("--val-rollouts", type=int, default=32)
    p.add_argument("--workers", type=int, default=None, help="render processes (default: CPU cores - 1)")
    p.add_argument("--tok-batch", type=int, default=64, help="frames per tokenizer batch")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = "cpu" if args.device == "auto" else args.device
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate = 2, 64, 2, 1, 128
        args.seq_frames, args.batch_size, args.warmup = 2, 1, 1
        args.steps = 2 if args.steps is None else args.steps
        args.n_rollouts, args.rollout_frames, args.val_rollouts = 3, 3, 1
        args.workers = 0 if args.workers is None else args.workers
        args.tok_batch = 4
        args.log_every = args.val_every = args.ckpt_every = 1
    if not 1 <= args.seq_frames <= MAX_FRAMES:
        p.error(f"--seq-frames must be 1..{MAX_FRAMES}")
    if args.rollout_frames < args.seq_frames:
        p.error("--rollout-frames must be at least --seq-frames")
    if args.tokenizer is None and not args.smoke:
        p.error("--tokenizer is required (a directory written by scripts/train/train_tokenizer.py)")
    return args


# ----------------------------------------------------------------------------------------------
# Data


def _tokenizer_fingerprint(tok_dir: Path | None) -> str:
    if tok_dir is None:
        return "random-smoke-tokenizer"
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        path = Path(tok_dir) / name
        if path.is_file():
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def prepare_data(args, load_tokenizer):
    """(tokens (N, F, 576) int16 or int32, actions (N, F, 6, 3) float32, codebook size)."""
    data_dir = args.out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    meta = {"seed": args.data_seed, "rollouts": args.n_rollouts, "frames": args.rollout_frames,
            "tokenizer": _tokenizer_fingerprint(args.tokenizer)}
    tok_path, act_path, meta_path = data_dir / "tokens.npy", data_dir / "actions.npy", data_dir / "data.json"
    if tok_path.is_file() and act_path.is_file() and meta_path.is_file():
        saved = json.loads(meta_path.read_text())
        if {k: saved.get(k) for k in meta} == meta:
            log(f"data: reusing {tok_path}")
            return np.load(tok_path), np.load(act_path), saved["codebook_size"], None
    meta_path.unlink(missing_ok=True)

    workers = common.render_workers(args.workers)
    # The pool forks here, before the tokenizer initialises CUDA.
    results = common.render_rollouts(args.data_seed, args.n_rollouts, args.rollout_frames, workers, chunksize=2)

    import torch

    tok = load_tokenizer()
    codebook = tok.codebook_size
    tok_dtype = np.int16 if codebook <= 2**15 else np.int32
    F = args.rollout_frames
    tokens = np.zeros((args.n_rollouts, F, IMAGE_TOKENS), tok_dtype)
    actions = np.zeros((args.n_rollouts, F, ACTION_TOKENS, 3), np.float32)
    model, device = tok.model, tok.device
    autocast = common.autocast(device)

    pending_imgs, pending_where = [], []

    def flush():
        if not pending_imgs:
            return
        batch = np.concatenate(pending_imgs)
        with torch.inference_mode(), autocast:
            x = torch.from_numpy(batch).to(device).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
            _, idx = model.quantize(model.encode(x))
        idx = idx.cpu().numpy()
        pos = 0
        for r, n in pending_where:
            tokens[r] = idx[pos:pos + n]
            pos += n
        pending_imgs.clear()
        pending_where.clear()

    t0 = time.time()
    for done, (index, imgs, acts) in enumerate(results, 1):
        actions[index] = acts
        pending_imgs.append(imgs)
        pending_where.append((index, len(imgs)))
        if sum(len(i) for i in pending_imgs) >= args.tok_batch:
            flush()
        if done % max(1, args.n_rollouts // 10) == 0:
            log(f"data: {done}/{args.n_rollouts} rollouts rendered and tokenized")
    flush()
    np.save(tok_path, tokens)
    np.save(act_path, actions)
    meta_path.write_text(json.dumps(meta | {"codebook_size": codebook}))
    n_frames = args.n_rollouts * F
    log(f"data: {n_frames} frames in {time.time() - t0:.1f}s ({n_frames / max(time.time() - t0, 1e-9):.0f} frames/s, "
        f"{workers} render workers, tokenizer on {device}); {len(np.unique(tokens))} distinct codes of {codebook}")
    return tokens, actions, codebook, tok


# ----------------------------------------------------------------------------------------------


def make_config(args, image_vocab: int):
    from terra_cli.models.config import layout_config

    return layout_config(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        image_vocab=image_vocab,
        image_tokens=IMAGE_TOKENS,
        action_tokens=ACTION_TOKENS,
        max_frames=MAX_FRAMES,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def load_tokenizer():
        from tokenizer_decoder import ImageTokenizer, small_config

        if args.tokenizer is None:
            log("smoke: random tokenizer (small_config: ch 32, z 10)")
            return ImageTokenizer.from_config(small_config(ch=32, z_channels=10), seed=0, device=args.device)
        return ImageTokenizer.from_pretrained(args.tokenizer, device=args.device, batch_size=args.tok_batch)

    tokens, actions, codebook, _ = prepare_data(args, load_tokenizer)

    import torch
    import torch.nn.functional as F

    from terra_cli.models.checkpoint import save_checkpoint
    from terra_cli.models.modeling_hf import build_model, load_model
    from tokenizer_decoder.tokenizer import pick_device

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    config = make_config(args, codebook)
    layout = config.layout
    model = build_model(config, device=device, dtype=torch.float32).train()
    n_params = sum(p.numel() for p in model.parameters())
    mib = 2**20
    save_dtype = torch.float32 if n_params * 4 <= args.max_mb * mib else torch.bfloat16
    save_mb = n_params * (4 if save_dtype == torch.float32 else 2) / mib
    log(f"model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} kv, mlp {args.intermediate}, "
        f"vocab {config.vocab_size}: {n_params / 1e6:.2f}M params -> saved as {str(save_dtype)[6:]} ({save_mb:.1f} MiB)")
    if save_mb > args.max_mb:
        log(f"warning: {save_mb:.1f} MiB is over --max-mb {args.max_mb} even in bfloat16")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), **fused)

    n_roll = tokens.shape[0]
    n_val = min(args.val_rollouts, max(1, n_roll // 10))
    train_ids, val_ids = np.arange(n_roll - n_val), np.arange(n_roll - n_val, n_roll)
    tokens_t = torch.from_numpy(tokens.astype(np.int64))
    actions_t = torch.from_numpy(actions)

    ckpt_path = args.out / "ckpt" / "state.pt"
    config_dict = config.to_diff_dict()
    step, train_seconds = common.load_state(args.resume, ckpt_path, model, opt, config_dict,
                                            "--resume: {path} holds a model of another config")
    rng = np.random.default_rng([args.seed, step])

    fwd = torch.compile(model) if args.compile else model

    T = args.seq_frames
    stride = layout.frame_stride

    def make_batch(ids: np.ndarray, starts: np.ndarray, offsets: np.ndarray):
        """input_ids (B, T*582), position_ids, waypoints (B, T*6, 3), labels (B, T*582-1) with -100 off image tokens."""
        B = len(ids)
        win = torch.stack([tokens_t[r, s:s + T] for r, s in zip(ids, starts)])  # (B, T, 576)
        acts = torch.stack([actions_t[r, s:s + T] for r, s in zip(ids, starts)])  # (B, T, 6, 3)
        seq = torch.full((B, T, stride), layout.action_placeholder_id, dtype=torch.long)
        seq[:, :, :IMAGE_TOKENS] = win
        seq = seq.reshape(B, T * stride)
        pos = torch.as_tensor(offsets, dtype=torch.long)[:, None] * stride + torch.arange(T * stride)[None, :]
        labels = seq[:, 1:].clone()
        labels[labels >= layout.image_vocab_size] = -100  # action slots are never targets
        return (seq.to(device, non_blocking=True), pos.to(device, non_blocking=True),
                acts.reshape(B, T * ACTION_TOKENS, 3).to(device, non_blocking=True), labels.to(device, non_blocking=True))

    def sample_windows(pool_ids: np.ndarray, n: int, generator: np.random.Generator):
        ids = generator.choice(pool_ids, size=n)
        starts = generator.integers(0, tokens.shape[1] - T + 1, size=n)
        offsets = generator.integers(0, MAX_FRAMES - T + 1, size=n)
        return ids, starts, offsets

    def loss_of(batch):
        seq, pos, acts, labels = batch
        with common.autocast(device):
            logits, _ = fwd(seq, pos, acts)
        logits = logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        with torch.no_grad():
            keep = labels != -100
            acc = (logits.argmax(-1)[keep] == labels[keep]).float().mean()
        return loss, acc

    val_rng = np.random.default_rng(12345)
    val_batches = [sample_windows(val_ids, args.batch_size, val_rng) for _ in range(4 if not args.smoke else 1)]

    @torch.no_grad()
    def validate() -> dict:
        model.eval()
        losses, accs = [], []
        for ids, starts, offsets in val_batches:
            loss, acc = loss_of(make_batch(ids, starts, offsets))
            losses.append(float(loss))
            accs.append(float(acc))
        model.train()
        return {"val_loss": float(np.mean(losses)), "val_acc": float(np.mean(accs))}

    def write_state(step: int, train_seconds: float):
        common.save_state(ckpt_path, model, opt, step, train_seconds, config_dict, args)

    fields = ["step", "time_s", "lr", "loss", "acc", "tokens_per_s", "val_loss", "val_acc"]
    clock = common.TrainingClock(args, opt, ckpt_path, step, train_seconds, 20, args.out / "log.csv", fields, write_state)

    t_log = time.time()
    agg_loss = agg_acc = 0.0
    n_agg = 0
    tokens_seen = 0
    while clock.next_step():
        opt.zero_grad(set_to_none=True)
        for _ in range(args.grad_accum):
            batch = make_batch(*sample_windows(train_ids, args.batch_size, rng))
            loss, acc = loss_of(batch)
            (loss / args.grad_accum).backward()
            agg_loss = agg_loss + loss.detach() / args.grad_accum  # on the device: no sync per step
            agg_acc = agg_acc + acc / args.grad_accum
            tokens_seen += batch[0].numel()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        clock.count_step()
        n_agg += 1
        row = None
        if clock.logs_now():
            now = time.time()
            row = {"loss": float(agg_loss) / n_agg, "acc": float(agg_acc) / n_agg,
                   "tokens_per_s": tokens_seen / max(now - t_log, 1e-9)}
            agg_loss = agg_acc = 0.0
            n_agg, tokens_seen, t_log = 0, 0, now
        if clock.validates_now():
            row = (row or {}) | validate()
        clock.record(row)
    clock.stop()
    step, train_seconds = clock.step, clock.train_seconds

    # Final weights in Terra's format, in the size-fitting dtype, and a strict reload.
    final_metrics = validate()
    config.dtype = str(save_dtype).replace("torch.", "")
    export = build_model(config, device="cpu", dtype=save_dtype)
    export.load_state_dict({k: v.detach().to("cpu", save_dtype) for k, v in model.state_dict().items()})
    wm_dir = args.out / "world_model"
    save_checkpoint(export, config, wm_dir)
    loaded = load_model(wm_dir)
    size = (wm_dir / "model.safetensors").stat().st_size
    summary = {"step": step, "train_minutes": train_seconds / 60, "params": n_params, "dtype": config.dtype,
               "weights_bytes": size, "world_model_dir": str(wm_dir), "tokenizer": str(args.tokenizer),
               "codebook_size": codebook, "seq_frames": T, **final_metrics}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"saved {wm_dir} ({size / mib:.1f} MiB, {config.dtype}; loads strictly: "
        f"{sum(p.numel() for p in loaded.parameters())} params); {json.dumps(final_metrics)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
