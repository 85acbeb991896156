"""vLLM vs the transformers reference on a Terra-size model (exact released config, random bf16
weights), on a GPU with CUDA graphs on. Writes parity.json to $OUT (or the current directory).

  python3 benchmarks/scripts/gpu_parity.py [--checkpoint /tmp/terra_random]

Reports:
- greedy agreement: the fraction of identical tokens in the first generated frame, vLLM vs HF,
  each running free (bf16 rounding differences can flip a near-tie, and the rest of the frame
  then follows a different prefix);
- teacher-forced logits: vLLM's frame is fed to HF in one forward pass, and at each of its 576
  positions HF's raw logits are compared with the raw logits vLLM reported for its top-20 ids
  (logprobs_mode=raw_logits): the max and mean absolute difference, and how often HF's argmax
  equals vLLM's token.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="/tmp/terra_random")
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on a small checkpoint")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))

    from vllm import SamplingParams

    from terra_cli.backends.hf import HfBackend
    from terra_cli.backends.vllm import VllmBackend, interleave
    from terra_cli.bench.hf_vs_vllm import bench_inputs, environment, write_random_terra_checkpoint
    from terra_cli.models.checkpoint import load_config
    from terra_cli.backends.base import Sampling

    ckpt = Path(args.checkpoint)
    dev = args.device
    dtype = "bfloat16" if dev == "cuda" else "float32"
    t0 = time.perf_counter()
    if not (ckpt / "config.json").exists():
        write_random_terra_checkpoint(ckpt, dev, seed=0)
    print(f"checkpoint ready in {time.perf_counter() - t0:.1f} s", flush=True)
    config = load_config(ckpt)
    layout = config.layout
    k = 3
    context, actions = bench_inputs(layout, k, k + 2, seed=0)
    greedy = Sampling(temperature=0)

    hf = HfBackend(ckpt, device=dev, dtype=dtype)
    t0 = time.perf_counter()
    hf_tokens = hf.generate(context, actions, k + 1, greedy)[0, k]
    hf_seconds = time.perf_counter() - t0
    print(f"hf greedy frame in {hf_seconds:.1f} s", flush=True)

    t0 = time.perf_counter()
    backend = VllmBackend(ckpt, device=dev, max_rollouts=4, logprobs_mode="raw_logits")
    startup = time.perf_counter() - t0
    print(f"vllm engine ready in {startup:.1f} s", flush=True)
    slots = [layout.action_placeholder_id] * layout.action_tokens
    prompt = [t for j in range(k) for t in (*context[j].tolist(), *slots)]  # the reference's layout
    request = {"prompt_token_ids": interleave(context[:k], backend.action_rows.ids_for(actions[:k]))}
    params = SamplingParams(temperature=0, max_tokens=layout.image_tokens, min_tokens=layout.image_tokens,
                            ignore_eos=True, logprobs=args.topk, detokenize=False)
    t0 = time.perf_counter()
    result = backend.llm.generate([request], params, use_tqdm=False)[0].outputs[0]
    vllm_seconds = time.perf_counter() - t0
    vllm_tokens = np.array(result.token_ids)
    same_free_running = float((vllm_tokens == hf_tokens).mean())
    first_divergence = int(np.argmax(vllm_tokens != hf_tokens)) if same_free_running < 1 else layout.image_tokens
    # The backend's own frame loop must give the same greedy frame as this direct call.
    loop_tokens = backend.generate(context, actions, k + 1, greedy)[0, k]
    backend.close()

    # Teacher forcing: HF reads vLLM's frame in one pass; compare raw logits position by position.
    model = hf.model
    ids = torch.tensor([prompt + vllm_tokens.tolist()], device=dev)
    positions = torch.arange(ids.shape[1], device=dev)[None]
    waypoints = torch.from_numpy(np.ascontiguousarray(actions[:k])).reshape(1, -1, 3).to(dev)
    with torch.inference_mode():
        logits, _ = model(ids, positions, waypoints, logits_to_keep=layout.image_tokens + 1)
    hf_logits = logits[0, :-1].float().cpu()  # position p predicts token p+1: the frame's 576 codes
    diffs, argmax_agree = [], 0
    for i, step in enumerate(result.logprobs):
        token_ids = list(step.keys())
        vllm_values = torch.tensor([step[t].logprob for t in token_ids])
        diffs.append((hf_logits[i, token_ids] - vllm_values).abs())
        argmax_agree += int(int(hf_logits[i, : layout.image_vocab_size].argmax()) == int(vllm_tokens[i]))
    diffs = torch.cat(diffs)
    report = {
        "model": "Terra world_model config (2,043,973,632 parameters), random weights, bfloat16"
        if config.num_hidden_layers == 22 else str(ckpt),
        "context_frames": k,
        "greedy_first_frame_identical_fraction": round(same_free_running, 4),
        "greedy_first_divergence_at_token": first_divergence,
        "backend_frame_loop_equals_direct_call": bool((loop_tokens == vllm_tokens).all()),
        "teacher_forced_max_abs_logit_diff": round(float(diffs.max()), 4),
        "teacher_forced_mean_abs_logit_diff": round(float(diffs.mean()), 5),
        "teacher_forced_logit_scale_std": round(float(hf_logits.std()), 4),
        "teacher_forced_hf_argmax_equals_vllm_token": round(argmax_agree / layout.image_tokens, 4),
        "topk_compared": args.topk,
        "hf_greedy_frame_seconds": round(hf_seconds, 2),
        "vllm_greedy_frame_seconds": round(vllm_seconds, 3),
        "vllm_startup_seconds": round(startup, 1),
        "cuda_graphs": "on (enforce_eager=False)",
        "environment": environment(),
    }
    print(json.dumps(report, indent=2), flush=True)
    (out_dir / "parity.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
