"""Issue 41's 32-session target: what one decode step costs when B rollouts share it.

A `terra serve` session on vLLM gets ~0.4 frames/s at 32 sessions (benchmarks/README.md: ~4.3 ms a step,
well above what the step reads). 0.6 frames/s a session needs a step of at most 1 / (0.6 * 582) = 2.86 ms.
This probe measures the step a batched static-KV decoder would run, before building one: B rows, each
row's keys in a region of its own of one cache (FlashAttention's paged layout, a block table a row,
`seqused_k` a row), one code a row at the row's own position, the product's decode-step pieces
(`StaticKVDecoder`'s compiled layer functions with fused projections and k and v written in them,
one FlashAttention plan a step, lm_head over the B rows), and per-row seeded sampling (one generator
a row, the exponential race of `device_sampling`), the whole step one CUDA graph replayed back to back.

For each B in --rows and each context (frames already in the rows' caches) in --contexts: ms a step,
frames/s a session (1 / (582 * step)), the bytes a step must read (weights once, each row's keys and
values) and the step's time at the card's bandwidth. Random weights in Terra's shapes, bf16.

--check (CPU, a tiny model, FlashAttention's paged contract written plainly): the batched step's
logits equal each row's own single-row decoder's at the same position, to float32 rounding.

--product: the product's row batch (`backends/row_batch.RowBatchDecoder`, what `terra serve` on
`--backend single-stream` runs for sessions that ask together) for each B in --rows: B rollouts with a
3-frame context, 4 frames each, at temperature 0.9; s a frame over the middle frames (prompts and the
first frame's graph capture and compile before them), frames/s a rollout and in all, beside one rollout
alone on `SingleStreamDecoder`.

    python3 benchmarks/scripts/gpu_batched_step.py --rows 1,8,32 --contexts 3,12,24 --out $OUT/batched_step.json
    python3 benchmarks/scripts/gpu_batched_step.py --check
    python3 benchmarks/scripts/gpu_batched_step.py --sessions 8,32 --frames 8 --think-ms 30 --out $OUT/sessions.json

--sessions: the product's driver fed as a server's sessions feed it, without the server (`measure_sessions`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from terra_cli.backends import flash_cache, static_kv  # noqa: E402
from terra_cli.models.config import LlamaActionConfig  # noqa: E402
from terra_cli.models.modeling_hf import build_model  # noqa: E402
from terra_cli.models.testing import TERRA_WORLD_MODEL_CONFIG, tiny_config  # noqa: E402

MID_FRAME = 300  # the rows' position inside their frame: keys read = context frames' + this many


class BatchedStep:
    """B rows of one decode step over `core`'s weights and layer functions; the rows' caches are
    (1, B * P, KV, d), row b's positions at [b * P, (b + 1) * P)."""

    def __init__(self, core: static_kv.StaticKVDecoder, rows: int, kernel, version: int, planner=None,
                 head: str = "linear"):
        self.core, self.rows, self.kernel, self.version, self.planner = core, rows, kernel, version, planner
        self.head = head  # lm_head: "linear" (cuBLAS), "weight-major" (W @ h.T), "decoder" (`core.logits`)
        self.layers_only = False  # time the layers alone: no lm_head, no sampling
        device = core.device
        # whole FlashAttention blocks a row (a CPU's single-row cache need not be)
        page = self.page = flash_cache.flash_page()
        self.P = P = -(-core.cache_positions // page) * page
        shape = (1, rows * P, core.kv_heads, core.head_dim)
        self.keys = [torch.zeros(shape, dtype=core.dtype, device=device) for _ in core.layers]
        self.values = [torch.zeros(shape, dtype=core.dtype, device=device) for _ in core.layers]
        blocks = P // page
        self.block_table = (torch.arange(rows, device=device)[:, None] * blocks
                            + torch.arange(blocks, device=device)[None]).to(torch.int32)
        self.query_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.row_offsets = torch.arange(rows, device=device) * P
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.codes = torch.zeros(rows, dtype=torch.long, device=device)
        self.generators = [torch.Generator(device=device) for _ in range(rows)]
        self.noise = torch.empty(rows, core.layout.image_vocab_size, dtype=torch.float32, device=device)
        self.ops = core.ops.for_rows(True)

    def logits(self) -> torch.Tensor:
        core, B = self.core, self.rows
        embeds = core.embed_codes(self.codes, self.positions)  # (1, B, H)
        cos, sin = core.model.model.rotary_emb(embeds, self.positions[None])
        flat = self.row_offsets + self.positions
        seen = (self.positions + 1).to(torch.int32)
        planned = {}
        if self.planner is not None:
            planned["scheduler_metadata"] = self.planner(
                batch_size=B, max_seqlen_q=1, max_seqlen_k=self.P, num_heads_q=core.heads,
                num_heads_kv=core.kv_heads, headdim=core.head_dim, cache_seqlens=seen, qkv_dtype=core.dtype,
                cu_seqlens_q=self.query_starts, page_size=self.page, causal=True)
        x = embeds
        paged = (-1, self.page, core.kv_heads, core.head_dim)
        for index, (layer, keys, values) in enumerate(zip(core.layers, self.keys, self.values)):
            q = self.ops.attention_inputs_written(index, x, cos, sin, keys, values, flat)
            out = self.kernel(q[0], keys.view(paged), values.view(paged), max_seqlen_q=1, cu_seqlens_q=self.query_starts,
                              max_seqlen_k=self.P, seqused_k=seen, block_table=self.block_table,
                              softmax_scale=layer.self_attn.scaling, causal=True, fa_version=self.version, **planned)
            x = self.ops.attention_output_and_mlp(index, x, out.reshape(1, B, -1))
        hidden = core.model.model.norm(x)[0]
        if self.layers_only:
            return hidden
        if self.head == "decoder":
            return core.logits(hidden)
        if self.head == "weight-major":
            return (core.model.lm_head.weight @ hidden.t()).t()
        return core.model.lm_head(hidden)

    def step(self, temperature: float = 0.9) -> None:
        """One code a row, drawn from its own generator (the exponential race), then the next position."""
        if self.layers_only:
            self.logits()
            self.positions.add_(1)
            return
        probabilities = (self.logits()[:, : self.noise.shape[1]].float() / temperature).softmax(dim=-1)
        for row, generator in enumerate(self.generators):
            self.noise[row].exponential_(generator=generator)
        self.codes.copy_((probabilities / self.noise).argmax(dim=-1))
        self.positions.add_(1)


def paged_rows_attention(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, block_table, softmax_scale,
                         causal, fa_version, scheduler_metadata=None):
    """FlashAttention's paged varlen contract at one query a row, written plainly (the CPU check)."""
    assert max_seqlen_q == 1 and causal and cu_seqlens_q.tolist() == list(range(q.shape[0] + 1))
    rows = []
    for b in range(q.shape[0]):
        used = int(seqused_k[b])
        keys = k[block_table[b].long()].flatten(0, 1)[:used]
        values = v[block_table[b].long()].flatten(0, 1)[:used]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,khd->hk", q[b].float(), keys.float()) * softmax_scale).softmax(-1)
        rows.append(torch.einsum("hk,khd->hd", weights, values.float()).to(q.dtype))
    return torch.stack(rows)


def place_rows(batched: BatchedStep, context_positions: list[int], random_cache: bool = False, seed: int = 0) -> None:
    """Each row's position (the keys before it count as written) and code; with `random_cache`, random
    keys and values everywhere (the CPU check; the timing reads the same bytes whatever they hold)."""
    assert max(context_positions) < batched.core.max_positions
    generator = torch.Generator().manual_seed(seed)
    if random_cache:
        for keys, values in zip(batched.keys, batched.values):
            for tensor in (keys, values):
                tensor.copy_((torch.randn(tensor.shape, generator=generator) * 0.5).to(tensor.dtype))
    batched.positions.copy_(torch.tensor(context_positions))
    codes = torch.randint(0, batched.core.layout.image_vocab_size, (batched.rows,), generator=generator)
    batched.codes.copy_(codes)


@torch.inference_mode()
def check() -> dict:
    """Each row's logits from the batched step against a single-row decoder holding that row's cache."""
    torch.manual_seed(0)
    model = build_model(tiny_config(layers=2, hidden_size=64, heads=4, kv_heads=2), "cpu", torch.float32)
    core = static_kv.StaticKVDecoder(model, compile_layers=False)
    core.ops = static_kv.LayerOps(model, compile_layers=False, fuse_projections=True)
    batched = BatchedStep(core, 3, paged_rows_attention, 3)
    place_rows(batched, [700, 1500, 40], random_cache=True)
    codes, positions = batched.codes.clone(), batched.positions.clone()
    got = batched.logits()
    P, kept = batched.P, core.cache_positions
    worst = 0.0
    for b in range(3):
        for layer, (keys, values) in enumerate(zip(batched.keys, batched.values)):
            # the single-row torch path keeps (1, KV, P, d)
            core.keys[layer].copy_(keys[:, b * P:b * P + kept].transpose(1, 2))
            core.values[layer].copy_(values[:, b * P:b * P + kept].transpose(1, 2))
        position = positions[b: b + 1]
        want = core.forward_codes(codes[b: b + 1], position, int(position) + 1)
        worst = max(worst, float((got[b] - want[0]).abs().max()))
    assert worst < 1e-4, f"batched logits differ from the single-row decoder's by {worst}"
    batched.step()  # the sampler runs and every row moves one position on
    assert batched.positions.tolist() == (positions + 1).tolist()
    return {"check": "batched step's logits equal each row's single-row decoder's", "max_abs_diff": worst}


def time_step(batched: BatchedStep, replays: int) -> float:
    graph = torch.cuda.CUDAGraph()
    for generator in batched.generators:
        graph.register_generator_state(generator)
    saved = batched.positions.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            batched.step()
    torch.cuda.current_stream().wait_stream(side)
    batched.positions.copy_(saved)
    with torch.cuda.graph(graph):
        batched.step()
    batched.positions.copy_(saved)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / replays


@torch.inference_mode()
def measure(rows_list: list[int], contexts: list[int], replays: int, heads: list[str]) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(LlamaActionConfig(**TERRA_WORLD_MODEL_CONFIG), device, torch.bfloat16)
    core = static_kv.StaticKVDecoder(model)
    kernel, version = flash_cache.flash_varlen_kernel(device, core.dtype)
    planner = flash_cache.flash_planner(version)
    stride = core.layout.frame_stride
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed" not in name)
    kv_bytes_per_position = 2 * len(core.layers) * core.kv_heads * core.head_dim * 2
    bandwidth = 4.8e12  # H200's HBM3e, bytes/s
    results = []
    for rows in rows_list:
        batched = BatchedStep(core, rows, kernel, version, planner)
        for context, head in [(c, h) for c in contexts for h in heads + ["layers only"]]:
            position = context * stride + MID_FRAME
            place_rows(batched, [position] * rows)
            batched.layers_only, batched.head = head == "layers only", head
            started = time.perf_counter()
            seconds = time_step(batched, replays)
            read = weight_bytes + rows * (position + 1) * kv_bytes_per_position
            results.append({"rows": rows, "context_frames": context, "head": head, "keys_a_row": position + 1,
                            "ms_per_step": round(seconds * 1e3, 4),
                            "frames_per_s_per_session": round(1 / (stride * seconds), 3),
                            "frames_per_s_all": round(rows / (stride * seconds), 2),
                            "gb_read_per_step": round(read / 1e9, 3),
                            "ms_at_bandwidth": round(read / bandwidth * 1e3, 4),
                            "capture_and_time_s": round(time.perf_counter() - started, 1)})
            print(json.dumps(results[-1]), flush=True)
        del batched
        torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "replays": replays,
            "compiled_layers": core.compiled, "compile_error": core.ops.compile_error,
            "flash_plan_a_step": planner is not None, "weight_gb": round(weight_bytes / 1e9, 3),
            "target_ms_for_0_6_frames_per_s": round(1 / (0.6 * stride) * 1e3, 3), "results": results}


@torch.inference_mode()
def measure_product(rows_list: list[int]) -> dict:
    import numpy as np

    from terra_cli.backends.base import Sampling
    from terra_cli.backends.row_batch import RowBatchDecoder, RowWork
    from terra_cli.backends.single_stream import SingleStreamDecoder

    cuda = torch.cuda.is_available()  # without one: a tiny model on the CPU, a dry run of this script
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    config = LlamaActionConfig(**TERRA_WORLD_MODEL_CONFIG) if cuda else tiny_config(image_vocab=64, image_tokens=40)
    model = build_model(config, device, torch.bfloat16 if cuda else torch.float32)
    single = SingleStreamDecoder(model, cuda_graphs=cuda)
    layout, sampling = model.layout, Sampling(temperature=0.9)
    rng = np.random.default_rng(0)

    def work(seed: int) -> RowWork:
        context = rng.integers(0, layout.image_vocab_size, size=(3, layout.image_tokens))
        return RowWork(context, rng.normal(size=(6, layout.action_tokens, 3)).astype(np.float32), 7, seed)

    results = []
    alone = work(0)
    single.rollout(alone.context, alone.actions, 5, sampling, 0)
    results.append({"rows": 1, "path": "SingleStreamDecoder", "s_per_frame": round(float(np.mean(single.stats["frame_seconds"][1:])), 4)})
    print(json.dumps(results[-1]), flush=True)
    batch = RowBatchDecoder(single.core, max(rows_list), cuda_graphs=cuda)
    for rows in rows_list:
        stamps = []

        def on_frame(i, f, tokens):
            if i == 0:
                if cuda:
                    torch.cuda.synchronize()
                stamps.append(time.perf_counter())

        batch.rollouts([work(r) for r in range(rows)], sampling, on_frame=on_frame)
        # with run-ahead on CUDA a frame is handed out when the next frame's steps are done, the last at once
        frame_s = (stamps[-2] - stamps[0]) / (len(stamps) - 2)
        results.append({"rows": rows, "path": "RowBatchDecoder", "s_per_frame": round(frame_s, 4),
                        "frames_per_s_per_rollout": round(1 / frame_s, 3), "frames_per_s_all": round(rows / frame_s, 2)})
        print(json.dumps(results[-1]), flush=True)
    return {"gpu": torch.cuda.get_device_name() if cuda else "none (a CPU dry run)", "compiled_layers": single.core.compiled, "attention": single.core.attention,
            "note": "s_per_frame: frames 2-3 of the 4 generated (a frame is handed out once the next one's steps are done: "
                    "`RowBatchDecoder.run_ahead`)", "results": results}


def profile_rows(rows: int, steps: int = 64, context: int = 3, kv_cache_dtype: str | None = None,
                 quantization: str | None = None) -> dict:
    """`--profile N`: the product's row batch of N rows (`RowBatchDecoder`, `context`-frame contexts (3),
    temperature 0.9; `kv_cache_dtype` fp8: the rows' caches in fp8; `quantization` fp8: the layers' and
    lm_head's weights in fp8 through the few-rows kernel, as `--quantization fp8` runs them) mid-frame:
    `steps` decode steps as CUDA graph replays, timed, then as many launched eagerly under torch's
    profiler: each kernel's GPU time a step, heaviest first, beside the replays' wall time a step."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from terra_cli.backends.base import Sampling
    from terra_cli.backends.row_batch import RowBatchDecoder, RowWork
    from terra_cli.backends import FP8_CACHE_DTYPES
    from terra_cli.backends.single_stream import SingleStreamDecoder

    torch.manual_seed(0)
    model = build_model(LlamaActionConfig(**TERRA_WORLD_MODEL_CONFIG), torch.device("cuda"), torch.bfloat16)
    single = SingleStreamDecoder(model, cuda_graphs=True, fp8_cache=kv_cache_dtype in FP8_CACHE_DTYPES,
                                 fp8_weights=quantization == "fp8")
    layout, sampling = model.layout, Sampling(temperature=0.9)
    rng = np.random.default_rng(0)
    work = [RowWork(rng.integers(0, layout.image_vocab_size, size=(context, layout.image_tokens)),
                    rng.normal(size=(context, layout.action_tokens, 3)).astype(np.float32), context + 1, seed)
            for seed in range(rows)]
    batch = RowBatchDecoder(single.core, rows, cuda_graphs=True)
    batch.warm_up(sampling)
    with torch.inference_mode():
        batch.add(list(enumerate(work)), sampling)
        batch.advance(32)  # compiled and captured before the timed steps
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        batch.run_steps(rows, steps)  # graph replays, timed
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    # the same replays under the profiler: CUPTI reports a graph's kernels one by one, so the time at least one
    # kernel runs over the span from the first's start to the last's end is how busy the GPU is (kernels that
    # overlap, a programmatic launch's early start or the noise's streams, count once)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as replays:
        batch.run_steps(rows, steps)
        torch.cuda.synchronize()
    replay_busy = busy_share([(event.time_range.start, event.time_range.end) for event in replays.events()
                              if event.device_type == torch.autograd.DeviceType.CUDA])
    batch.cuda_graphs = False  # the same step's kernels launched one by one, so the profiler names each
    # in inference mode, as `advance` runs (outside it dynamo compiles the layers again, the caches' writes as copies)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        batch.run_steps(rows, steps)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    launches = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total / 1000
            launches += 1
    busy = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda item: -item[1])[:30]
    result = {"rows": rows, "steps": steps, "context_frames": context, "kv_cache_dtype": kv_cache_dtype or "auto",
              "quantization": quantization or "none",
              # a failed compile runs the layers eagerly (EagerFallback): name it, or the profile reads as the product's
              "compiled_layers": single.core.compiled, "compile_error": single.core.ops.compile_error,
              "compiled_step_inputs": single.core.prologue.compiled, "step_inputs_error": single.core.prologue.error,
              "lab_switches": lab_switches(),
              "sampler_error": single.sampler.error,
              "ms_per_step_wall": round(wall * 1000 / steps, 4),
              "ms_per_step_kernels": round(busy / steps, 4), "kernels_per_step": round(launches / steps, 1),
              # the eager kernels' time over the replays' wall: kernels on parallel streams (a row batch's noise)
              # or launched early each count, so it can pass 1
              "kernels_over_wall": round(busy / (wall * 1000), 3),
              # issue 41's 95%: the replays' own kernels, overlaps counted once (None: CUPTI saw none)
              "gpu_busy_share": replay_busy["share"], "gpu_busy_kernels": replay_busy["kernels"],
              "gpu_busy_span_ms_per_step": round(replay_busy["span_us"] / 1000 / steps, 4),
              "kernels_ms_per_step": [{"name": name[:160], "ms": round(ms / steps, 4)} for name, ms in top]}
    print(json.dumps(result, indent=1), flush=True)
    return result


def busy_share(intervals: list[tuple[float, float]]) -> dict:
    """The share of the span from the first interval's start to the last one's end covered by at least one
    interval, that covered time and the span (in the intervals' unit, microseconds here), and how many there
    were."""
    if not intervals:
        return {"share": None, "kernels": 0, "span_us": 0.0, "covered_us": 0.0}
    intervals = sorted(intervals)
    covered, run_start, run_end = 0.0, intervals[0][0], intervals[0][1]
    for start, end in intervals[1:]:
        if start > run_end:
            covered += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    covered += run_end - run_start
    span = run_end - intervals[0][0]  # the last run ends last: each starts past the one before's end
    return {"share": round(covered / span, 4) if span > 0 else None, "kernels": len(intervals), "span_us": span,
            "covered_us": covered}


def lab_switches() -> dict:
    """The decode step's lab switches this run was given (what `gpu_lean41.sh` varies between runs)."""
    import os

    from terra_cli.kernels import few_rows_matmul

    names = ("TERRA_FEW_ROWS_SPLITS", "TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS", "TERRA_SINGLE_STREAM_LAYERS",
             "TERRA_NOISE_STREAMS", "TERRA_SAMPLER_CHUNKS", "TORCHINDUCTOR_ENABLE_PDL",
             "TERRA_FEW_ROWS_PDL", "TERRA_SINGLE_STREAM_ROTARY", "TERRA_STEP_PROLOGUE")
    switches = {name: os.environ[name] for name in names if os.environ.get(name)}
    from terra_cli.backends.step_compile import launch_options

    switches["step_launch_options"] = launch_options()  # what the step's own compiles take (2026-12-07e: PDL on)
    if os.environ.get("TORCHINDUCTOR_ENABLE_PDL"):  # whether this torch's Inductor knows the switch at all
        from torch._inductor import config

        switches["inductor_enable_pdl"] = getattr(config.triton, "enable_pdl", None)
    if few_rows_matmul.tile_override is not None:  # --tile
        switches["tile"] = list(vars(few_rows_matmul.tile_override).values())
    return switches


def measure_sessions(sessions_list: list[int], frames: int, think_ms: float, kv_cache_dtype: str | None = None,
                     quantization: str | None = None) -> dict:
    """`--sessions`: the product's driver (`single_stream_driver`, rows joining at any few steps' end) fed as
    a server's sessions feed it, without the server: each session's next frame is put `think_ms` after its
    last one is done (its picture and round trip), urgent, its context the frames so far."""
    import hashlib
    import tempfile
    import threading

    import numpy as np

    from terra_cli.backends import load_backend
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.driver import JobFeed, RolloutJob

    cuda = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="terra-sessions-"))
    torch.manual_seed(0)
    if cuda:
        from terra_cli.bench.cache import random_terra_checkpoint

        checkpoint = random_terra_checkpoint("cuda", 0)
    else:
        from terra_cli.models.testing import write_tiny_checkpoint

        checkpoint = write_tiny_checkpoint(folder, tiny_config(image_vocab=64, image_tokens=40), seed=0)
    backend = load_backend("single-stream", checkpoint, device="cuda" if cuda else "cpu",
                           dtype="bfloat16" if cuda else "float32", **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}),
                           **({"quantization": quantization} if quantization else {}))
    layout = backend.config.layout
    rng = np.random.default_rng(0)
    results = []
    for count in sessions_list:
        driver = backend.driver(max(sessions_list))
        reused_before = backend.rows.prompts_reused if backend.rows else 0
        feed, lock, done_at = JobFeed(), threading.Lock(), {s: [] for s in range(count)}
        history = {s: rng.integers(0, layout.image_vocab_size, size=(3, layout.image_tokens)) for s in range(count)}
        actions = rng.normal(size=(32, layout.action_tokens, 3)).astype(np.float32)

        def job(s: int) -> RolloutJob:
            context = history[s]
            return RolloutJob(f"{s}#{len(context)}", context, actions[:len(context)], len(context) + 1,
                              Sampling(temperature=0.9, seed=s), affinity=f"session-{s}")

        def on_done(j, tokens, count=count):
            s = int(j.key.split("#")[0])
            with lock:
                history[s] = tokens
                done_at[s].append(time.perf_counter())
                if len(done_at[s]) < frames:
                    threading.Timer(think_ms / 1000, lambda: feed.put(job(s), urgent=True)).start()
                elif all(len(t) == frames for t in done_at.values()):
                    feed.close()

        started = time.perf_counter()
        for s in range(count):
            feed.put(job(s))
        driver.run(feed, on_done=on_done)
        wall = time.perf_counter() - started
        after_first = [(frames - 1) / (t[-1] - t[0]) for t in done_at.values()]
        results.append({"sessions": count, "frames": frames, "think_ms": think_ms, "wall_s": round(wall, 2),
                        "frames_per_s_per_session_after_first": round(float(np.mean(after_first)), 3),
                        "frames_per_s_all": round(count * frames / wall, 2),
                        "kv_cache_dtype": kv_cache_dtype or "auto", "quantization": quantization or "none",
                        "distinct_codes_in_a_last_frame": int(len(np.unique(history[0][-1]))),  # (NaNs would draw one)
                        # every session's frames: a seed gives a session the same codes whatever the batching, so
                        # runs of the same weights and caches must agree (a lab switch that changes no draw)
                        "codes_sha256": hashlib.sha256(b"".join(np.ascontiguousarray(history[s], dtype=np.int64)
                                                                .tobytes() for s in range(count))).hexdigest()[:16],
                        "compiled_layers": backend.decoder.core.compiled, "lab_switches": lab_switches(),
                        "compile_error": backend.decoder.core.ops.compile_error,
                        "compiled_step_inputs": backend.decoder.core.prologue.compiled,
                        "step_inputs_error": backend.decoder.core.prologue.error,
                        "joins": driver.loop.batches, "prompts_reused": (backend.rows.prompts_reused if backend.rows else 0) - reused_before,
                        "loop": driver.loop.as_dict()})
        print(json.dumps(results[-1]), flush=True)
    backend.close()
    return {"gpu": torch.cuda.get_device_name() if cuda else "none (a CPU dry run)", "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--contexts", default="3,12,24", help="frames already in each row's cache")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--heads", default="linear,decoder,weight-major",
                        help="lm_head's kernels to time (each point also times the layers alone)")
    parser.add_argument("--check", action="store_true", help="the CPU check of the batched step's math")
    parser.add_argument("--product", action="store_true", help="time the product's row batch (row_batch.py)")
    parser.add_argument("--sessions", default="", help="sessions through the product's driver, e.g. 8,32 (no server)")
    parser.add_argument("--frames", type=int, default=8, help="--sessions: frames a session asks for")
    parser.add_argument("--think-ms", type=float, default=30.0, help="--sessions: from a frame to the next one's job")
    parser.add_argument("--kv-cache-dtype", default=None, help="--sessions, --profile: fp8 keeps the rows' caches in fp8")
    parser.add_argument("--quantization", default=None, help="--sessions, --profile: fp8 weights (the few-rows kernel)")
    parser.add_argument("--profile", type=int, default=0, help="the row batch of this many rows under torch's profiler")
    parser.add_argument("--profile-context", type=int, default=3, help="--profile: frames in each row's cache")
    parser.add_argument("--tile", default=None, help="--sessions, --profile: one few-rows kernel tile for every call, "
                        "BLOCK_N,BLOCK_K,WARPS,STAGES (e.g. 128,128,4,4: the 32-row fp8 tile before 2026-12-07c)")
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    if options.out is not None and options.out.exists():  # before minutes of work: a file it did not make stays
        parser.error(f"{options.out} exists; remove it or name another --out")
    if options.tile:
        from terra_cli.kernels import few_rows_matmul

        try:
            block_n, block_k, warps, stages = (int(part) for part in options.tile.split(","))
        except ValueError:
            parser.error(f"--tile {options.tile!r}: four whole numbers, BLOCK_N,BLOCK_K,WARPS,STAGES")
        # set before any weights are bound: the slices each projection gets are chosen from the tile
        few_rows_matmul.tile_override = few_rows_matmul.Tile(block_n, block_k, warps, stages)
    if options.profile:
        result = profile_rows(options.profile, context=options.profile_context, kv_cache_dtype=options.kv_cache_dtype,
                              quantization=options.quantization)
    elif options.sessions:
        result = measure_sessions([int(n) for n in options.sessions.split(",")], options.frames, options.think_ms,
                                  options.kv_cache_dtype, options.quantization)
    elif options.check:
        result = check()
    elif options.product:
        result = measure_product([int(r) for r in options.rows.split(",")])
    else:
        result = measure([int(r) for r in options.rows.split(",")], [int(c) for c in options.contexts.split(",")],
                         options.replays, options.heads.split(","))
    print(json.dumps(result, indent=1))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        with open(options.out, "x") as f:  # "x": never replaces a file that appeared meanwhile
            f.write(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
