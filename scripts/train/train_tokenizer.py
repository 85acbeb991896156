#!/usr/bin/env python
"""Train a small LFQ image tokenizer (terra-mini) on frames of the synthetic driving world.

Same architecture family as Terra's tokenizer (`tokenizer_decoder`: Open-MAGVIT2-style encoder,
lookup-free quantizer, adaptive-norm decoder; 16x downsampling, so 288x512 -> 18x32 = 576 tokens),
with a small codebook (2**z_channels, z_channels 10 by default).

Data: frames of seeded rollouts from `terra_cli.synthetic_world`, rendered once at the start by a
pool of CPU workers into a uint8 memmap in the output directory (reused on --resume).

Losses: L1 + L2 on pixels; LFQ commitment ||z - sg(sign z)||^2; LFQ entropy term (mean per-token
entropy of the soft code assignment minus the entropy of the batch-averaged assignment, as
Open-MAGVIT2 does). Straight-through estimator. No GAN, no perceptual loss. AdamW, warmup + cosine,
bf16 autocast on GPU.

Stops after --steps or --max-minutes (counted from the start, data rendering included), whichever
comes first; checkpoints every --ckpt-every steps into OUT/ckpt/state.pt (--resume continues from
it); logs to stdout and OUT/log.csv; writes the result with `ImageTokenizer.save_pretrained` to
OUT/tokenizer (config.json + model.safetensors) and checks that it loads strictly.

    python scripts/train/train_tokenizer.py --out runs/tok            # ~9 minutes on one GPU
    python scripts/train/train_tokenizer.py --out runs/tok --resume   # continue
    python scripts/train/train_tokenizer.py --smoke --out /tmp/tok    # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

import _train_common as common
from _train_common import log

H, W = 288, 512


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_arguments(p, smoke_help="tiny model, 2 steps, CPU: checks the pipeline in seconds",
                             schedule_default="--max-minutes minus data time", lr=4e-4, weight_decay=1e-4, val_every=500)
    # model
    p.add_argument("--ch", type=int, default=64)
    p.add_argument("--ch-mult", default="1,1,2,2,2",
                   help="5 levels = 16x downsampling (576 tokens at 288x512); the default keeps the file < 20 MiB")
    p.add_argument("--num-res-blocks", type=int, default=1)
    p.add_argument("--z-channels", type=int, default=10, help="codebook size 2**z_channels (10 to 12)")
    # optimisation
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--l1-weight", type=float, default=1.0)
    p.add_argument("--l2-weight", type=float, default=1.0)
    p.add_argument("--commit-weight", type=float, default=0.25)
    p.add_argument("--entropy-weight", type=float, default=0.05)
    p.add_argument("--entropy-inv-temp", type=float, default=100.0)
    # data
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--n-frames", type=int, default=12000, help="frames rendered for training (and validation)")
    p.add_argument("--rollout-frames", type=int, default=6, help="frames per rollout (short: more worlds)")
    p.add_argument("--val-frames", type=int, default=64)
    p.add_argument("--workers", type=int, default=None, help="render processes (default: CPU cores - 1)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = "cpu" if args.device == "auto" else args.device
        args.ch, args.ch_mult, args.num_res_blocks, args.z_channels = 32, "1,1,2,2,4", 1, 10
        args.batch_size, args.steps, args.warmup = 1, 2 if args.steps is None else args.steps, 1
        args.n_frames, args.rollout_frames, args.val_frames = 4, 2, 1
        args.workers = 0 if args.workers is None else args.workers
        args.log_every = args.val_every = args.ckpt_every = 1
    return args


# ----------------------------------------------------------------------------------------------
# Data: rendered once into OUT/data/frames.npy (uint8 memmap)


def prepare_frames(args) -> np.ndarray:
    data_dir = args.out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    n_roll = math.ceil(args.n_frames / args.rollout_frames)
    n = n_roll * args.rollout_frames
    meta = {"seed": args.data_seed, "rollouts": n_roll, "rollout_frames": args.rollout_frames, "frames": n}
    path, meta_path = data_dir / "frames.npy", data_dir / "frames.json"
    if path.is_file() and meta_path.is_file() and json.loads(meta_path.read_text()) == meta:
        log(f"data: reusing {path} ({n} frames)")
        return np.load(path, mmap_mode="r")
    meta_path.unlink(missing_ok=True)
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, H, W, 3))
    workers = common.render_workers(args.workers)
    t0 = time.time()
    rollouts = common.render_rollouts(args.data_seed, n_roll, args.rollout_frames, workers, chunksize=4)
    for done, (index, imgs, _) in enumerate(rollouts, 1):
        arr[index * args.rollout_frames:(index + 1) * args.rollout_frames] = imgs
        if workers > 0 and done % max(1, n_roll // 10) == 0:
            log(f"data: {done}/{n_roll} rollouts rendered")
    arr.flush()
    del arr
    meta_path.write_text(json.dumps(meta))
    log(f"data: rendered {n} frames in {time.time() - t0:.1f}s with {workers} workers -> {path}")
    return np.load(path, mmap_mode="r")


# ----------------------------------------------------------------------------------------------
# Losses


def lfq_losses(z, inv_temp: float):
    """(commitment, entropy, per-sample entropy, codebook entropy) for latents z (B, bits, h, w), float32."""
    import torch

    bits = z.shape[1]
    codes = torch.where(z > 0, 1.0, -1.0)
    commit = ((z - codes.detach()) ** 2).mean()
    flat = z.permute(0, 2, 3, 1).reshape(-1, bits)  # (N, bits)
    # Soft assignment over the 2**bits codebook: logits = -||z - c||^2 * inv_temp, up to a constant
    # in c this is 2 z.c * inv_temp. Computed per bit-group-free (the codebook is small).
    idx = torch.arange(2**bits, device=z.device)
    codebook = ((idx[:, None] >> torch.arange(bits, device=z.device)) & 1).float() * 2 - 1  # (K, bits), LSB first
    logits = 2 * inv_temp * flat @ codebook.T
    logp = torch.log_softmax(logits, dim=-1)
    prob = logp.exp()
    per_sample = -(prob * logp).sum(-1).mean()
    avg = prob.mean(0)
    codebook_ent = -(avg * torch.log(avg.clamp_min(1e-12))).sum()
    return commit, per_sample - codebook_ent, per_sample, codebook_ent


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    frames = prepare_frames(args)  # before CUDA is touched: the render pool forks

    import torch
    import torch.nn.functional as F

    from tokenizer_decoder import ImageTokenizer, TokenizerConfig, build_model, psnr
    from tokenizer_decoder.tokenizer import pick_device

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    config = TokenizerConfig(ch=args.ch, ch_mult=tuple(int(m) for m in args.ch_mult.split(",")),
                             num_res_blocks=args.num_res_blocks, z_channels=args.z_channels,
                             codebook_size=2**args.z_channels, resolution=W)
    if config.latent_hw(H, W) != (18, 32):
        raise SystemExit(f"ch_mult {args.ch_mult} gives a {config.latent_hw(H, W)} latent grid; need 18x32 (16x downsampling)")
    model = build_model(config, "cpu").to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: ch {config.ch} ch_mult {list(config.ch_mult)} res_blocks {config.num_res_blocks} "
        f"z {config.z_channels} (codebook {config.codebook_size}), {n_params / 1e6:.2f}M params, device {device}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.5, 0.9))

    n_total = frames.shape[0]
    n_val = min(args.val_frames, max(1, n_total // 10))
    train_ids = np.arange(0, n_total - n_val)
    val_ids = np.arange(n_total - n_val, n_total)

    ckpt_path = args.out / "ckpt" / "state.pt"
    step, train_seconds = common.load_state(args.resume, ckpt_path, model, opt, config.as_plain_dict(),
                                            "--resume: {path} was trained with {saved}, not {wanted}")
    rng = np.random.default_rng([args.seed, step])

    encoder, decoder = model.encoder, model.decoder
    if args.compile:
        encoder, decoder = torch.compile(encoder), torch.compile(decoder)

    def to_pixels(batch_u8: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(batch_u8)).to(device, non_blocking=True)
        x = x.permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
        return x.contiguous(memory_format=torch.channels_last) if device.type == "cuda" else x

    def write_state(step: int, train_seconds: float):
        common.save_state(ckpt_path, model, opt, step, train_seconds, config.as_plain_dict(), args)

    @torch.no_grad()
    def validate() -> dict:
        model.eval()
        psnrs, used = [], []
        for start in range(0, len(val_ids), max(1, args.batch_size)):
            ids = val_ids[start:start + args.batch_size]
            x = to_pixels(frames[ids])
            with common.autocast(device):
                z = model.encode(x)
            codes, indices = model.quantize(z.float())
            with common.autocast(device):
                rec = model.decode(codes)
            rec_u8 = ImageTokenizer.postprocess(rec)
            psnrs += [psnr(frames[i], r) for i, r in zip(ids, rec_u8)]
            used.append(indices.flatten().cpu())
        model.train()
        used = torch.cat(used)
        counts = torch.bincount(used, minlength=config.codebook_size).float()
        p = counts / counts.sum()
        perplexity = float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))
        return {"val_psnr": float(np.mean(psnrs)), "codes_used": int((counts > 0).sum()), "perplexity": perplexity}

    fields = ["step", "time_s", "lr", "loss", "l1", "l2", "commit", "entropy", "sample_ent", "codebook_ent",
              "val_psnr", "codes_used", "perplexity"]
    clock = common.TrainingClock(args, opt, ckpt_path, step, train_seconds, 25, args.out / "log.csv", fields, write_state)

    model.train()
    agg: dict = {}
    n_agg = 0
    while clock.next_step():
        ids = np.sort(rng.choice(train_ids, size=args.batch_size, replace=len(train_ids) < args.batch_size))
        x = to_pixels(frames[ids])
        with common.autocast(device):
            z = encoder(x)
        zf = z.float()
        commit, ent, ent_s, ent_c = lfq_losses(zf, args.entropy_inv_temp)
        q = zf + (torch.where(zf > 0, 1.0, -1.0) - zf).detach()  # straight-through
        with common.autocast(device):
            rec = decoder(q)
        rec = rec.float()
        l1 = (rec - x).abs().mean()
        l2 = F.mse_loss(rec, x)
        loss = args.l1_weight * l1 + args.l2_weight * l2 + args.commit_weight * commit + args.entropy_weight * ent
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        clock.count_step()
        # Accumulated on the device: no GPU sync per step.
        for k, v in (("loss", loss), ("l1", l1), ("l2", l2), ("commit", commit), ("entropy", ent),
                     ("sample_ent", ent_s), ("codebook_ent", ent_c)):
            agg[k] = agg.get(k, 0.0) + v.detach()
        n_agg += 1
        row = None
        if clock.logs_now():
            row = {k: float(v) / n_agg for k, v in agg.items()}
            agg, n_agg = {}, 0
        if clock.validates_now():
            row = (row or {}) | validate()
        clock.record(row)
    clock.stop()
    step, train_seconds = clock.step, clock.train_seconds

    # Final weights in the tokenizer's own format, and a strict reload.
    final = build_model(config, "cpu")
    final.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    tok_dir = args.out / "tokenizer"
    ImageTokenizer(final, device="cpu").save_pretrained(tok_dir)
    loaded = ImageTokenizer.from_pretrained(tok_dir, device="cpu")
    metrics = validate()
    sample = np.asarray(frames[val_ids[:1]])
    x = to_pixels(sample)
    model.eval()
    with torch.no_grad(), common.autocast(device):
        rec = ImageTokenizer.postprocess(model(x)[0])
    from PIL import Image

    Image.fromarray(np.concatenate([sample[0], rec[0]], axis=0)).save(args.out / "sample.png")
    summary = {"step": step, "train_minutes": train_seconds / 60, "params": n_params,
               "config": config.as_plain_dict(), "tokenizer_dir": str(tok_dir), **metrics}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"saved {tok_dir} (loads strictly: {loaded.num_parameters()} params); {json.dumps(metrics)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
