"""One rollout at the GPU's pace: terra's own decode loop over `modeling_hf`'s weights.

What differs from the reference loop (`backends/hf.py`): a static KV cache (`static_kv.py`), so
every decode step of a frame has the same shapes; the decoded codes, the step's position and the
sampler all stay on the device (`device_sampling.py`), so steps need no host round trip; and with
`cuda_graphs=True` one decode step (forward + sampler + bookkeeping) is captured once per frame's
key length and replayed back to back. A frame's codes come to the host once, when it is done.

Per frame: code 0 is drawn from the logits the previous frame's last action slot left (or the
prompt's), then steps decide codes 1..575, then one step feeds the last code with the frame's six
action slots. Plain decoding decides one code per step with the reference's exact rule and seeded
stream: frame f of the rollout seeded s draws from a generator seeded `seeds.draw_seed(s, f)`
(f counted from the video's first context frame: `first_frame` is the round's offset).
`draft_tokens=K > 0` runs speculative Jacobi steps instead (`jacobi.py`: exact in distribution,
not the same stream).

Many rollouts run one after the other on the same cache (this path is for one; batches are
vLLM's); `on_frame` then reports each frame once all rollouts have it. Front-ends reach it as
`--backend single-stream` through `single_stream_driver.SingleStreamDriver`.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from terra_cli.backends import FP8_CACHE_DTYPES
from terra_cli.backends.base import FrameCallback, Sampling, check_generation_inputs
from terra_cli.backends.device_sampling import FrameGenerators, StepSampler, draw_codes, next_codes
from terra_cli.backends.jacobi import DRAFTS, MAX_DRAFT_TOKENS, jacobi_step
from terra_cli.backends.static_kv import StaticKVDecoder
from terra_cli.errors import InputError
from terra_cli.seeds import rollout_seed
from terra_cli.models.modeling_hf import LlamaActionForCausalLM, load_model


def plain_step(decoder: "SingleStreamDecoder", key_length: int) -> None:
    """Feed the last decided code, decide the next one (no host sync)."""
    positions = decoder.frame_base + decoder.next_index - 1
    logits = decoder.core.forward_codes(decoder.last_token, positions, key_length)
    code = draw_codes(logits, decoder.layout, decoder.sampling, [decoder.generator], decoder.noise, decoder.sampler)
    decoder.frame_codes.index_copy_(0, decoder.next_index, code)
    decoder.last_token.copy_(code)
    decoder.next_index.add_(1)


class StepGraphs:
    """Runs a step eagerly, or as a CUDA graph captured once per (key length, sampling settings)
    and replayed `times` in a row with no host work in between."""

    def __init__(self, decoder: "SingleStreamDecoder", enabled: bool):
        self.decoder = decoder
        self.enabled = enabled
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if enabled else None
        self.captures = 0

    def run(self, step, key_length: int, times: int) -> None:
        if not self.enabled:
            for _ in range(times):
                step(self.decoder, key_length)
            return
        graph = self.ensure(step, key_length)
        for _ in range(times):
            graph.replay()

    def ensure(self, step, key_length: int):
        sampling = self.decoder.sampling
        key = (step.__name__, key_length, sampling.temperature, sampling.top_k, sampling.top_p)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self.capture(step, key_length)
        return graph

    def capture(self, step, key_length: int):
        decoder = self.decoder

        def use_generators(generators):
            decoder.generator = generators[0]

        graph = capture_step(lambda: step(decoder, key_length), decoder.state_tensors(), [decoder.generator],
                             use_generators, self.pool)
        self.captures += 1
        return graph


def capture_step(step, state: list[torch.Tensor], generators: list[torch.Generator], use_generators, pool):
    """`step()` as a CUDA graph that draws from `generators`. Warm-up steps execute for real: they draw
    from scratch generators (put in place by `use_generators(list)`) and the `state` they change is put
    back, so capturing changes no code and no draw. Their cache writes sit at positions the next real
    step rewrites with the same inputs."""
    saved = [t.clone() for t in state]
    use_generators([torch.Generator(device=g.device) for g in generators])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for tensor, value in zip(state, saved):
        tensor.copy_(value)
    use_generators(generators)
    graph = torch.cuda.CUDAGraph()
    # A generator other than the device's default must be registered, so that each replay
    # advances its offset (and a reseed between replays takes effect).
    for generator in generators:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph


class SingleStreamDecoder:
    """One rollout's static cache and device state; `rollout` generates one video round."""

    def __init__(self, model: LlamaActionForCausalLM, *, draft_tokens: int = 0, draft: str = "jacobi",
                 cuda_graphs: bool = False, compile_layers: bool | None = None, fp8_weights: bool = False,
                 fp8_cache: bool = False):
        if not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise InputError(f"draft_tokens must be from 0 (plain decoding) to {MAX_DRAFT_TOKENS}, got {draft_tokens}")
        if draft not in DRAFTS:
            raise InputError(f"draft must be {' or '.join(DRAFTS)} on this backend, got {draft!r}")
        self.core = StaticKVDecoder(model, compile_layers=compile_layers, fp8_weights=fp8_weights, fp8_cache=fp8_cache)
        device = self.core.device
        if cuda_graphs and device.type != "cuda":
            raise InputError(f"CUDA graphs need a CUDA device; the model is on {device}")
        self.layout = model.layout
        self.draft_tokens, self.draft = draft_tokens, draft
        codes, k = self.layout.image_tokens, draft_tokens
        long = dict(dtype=torch.long, device=device)
        self.last_token = torch.zeros(1, **long)
        self.next_index = torch.zeros(1, **long)
        self.frame_base = torch.zeros(1, **long)
        self.frame_codes = torch.zeros(codes + k + 1, **long)  # past `codes`: a sink for discarded rows
        self.previous_codes = torch.zeros(codes + k, **long)
        self.drafts = torch.zeros(k, **long)
        self.accepted = torch.zeros((), **long)
        self.window = torch.arange(k + 1, **long)
        self.sampling = Sampling()
        self.generator = torch.Generator(device=device)
        self.noise = torch.zeros(1, self.layout.image_vocab_size, dtype=torch.float32, device=device)
        self.sampler = StepSampler(self.core.compiled)
        self.graphs = StepGraphs(self, cuda_graphs)
        self.stats = {}

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.last_token, self.next_index, self.frame_base, self.frame_codes, self.previous_codes,
                self.drafts, self.accepted]

    @torch.inference_mode()
    def rollout(self, context: np.ndarray, actions: np.ndarray, num_frames: int, sampling: Sampling,
                rollout_seed: int, first_frame: int = 0, on_frame=None) -> np.ndarray:
        """context (K, T) int64, actions (num_frames - 1, A, 3) float32 (checked) -> (num_frames, T)."""
        layout, core = self.layout, self.core
        device, stride, codes = core.device, layout.frame_stride, layout.image_tokens
        known = context.shape[0]
        generators = FrameGenerators(self.generator, rollout_seed, first_frame)
        self.sampling = sampling
        waypoints = torch.tensor(actions, device=device)
        frames = np.empty((num_frames, codes), dtype=np.int64)
        frames[:known] = context
        context_t = torch.tensor(context, device=device)
        pending = core.forward_prompt(context_t, waypoints)
        self.frame_codes[:codes].copy_(context_t[-1])
        steps, frame_seconds = 0, []
        self.accepted.zero_()
        self.record_stats(0, 0, frame_seconds)
        for f in range(known, num_frames):
            started = time.perf_counter()
            self.previous_codes[:codes].copy_(self.frame_codes[:codes])
            code = next_codes(pending, layout, sampling, generators.start_frame(f))
            self.frame_codes[:1].copy_(code)
            self.last_token.copy_(code)
            self.next_index.fill_(1)
            self.frame_base.fill_(f * stride)
            steps += self.decide_frame(f)
            frame = self.frame_codes[:codes].cpu().numpy()  # the frame's one copy to the host
            frames[f] = frame
            if f < num_frames - 1:
                pending = core.forward_frame_end(self.frame_codes[codes - 1:codes], f, waypoints[f])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            frame_seconds.append(time.perf_counter() - started)
            self.record_stats(len(frame_seconds), steps, frame_seconds)  # kept per frame: a cut-off run has it
            if on_frame is not None:
                on_frame(f, frame)
        return frames

    def record_stats(self, frames: int, steps: int, frame_seconds: list[float]) -> None:
        decided = frames * (self.layout.image_tokens - 1)
        self.stats = {"frames": frames, "steps": steps, "codes_per_step": decided / steps if steps else None,
                      "accepted_drafts": int(self.accepted), "frame_seconds": frame_seconds,
                      "graphs_captured": self.graphs.captures, "attention": self.core.attention,
                      "compiled_layers": self.core.compiled, "compiled_step_inputs": self.core.prologue.compiled}

    @torch.inference_mode()
    def prepare(self, frames: range, sampling: Sampling) -> float:
        """Capture the CUDA graphs that generating `frames` (round-local indices) with `sampling`
        replays, before any timed region; returns the seconds it took (0 without graphs)."""
        if not self.graphs.enabled:
            return 0.0
        started = time.perf_counter()
        self.sampling = sampling
        step = plain_step if self.draft_tokens == 0 else jacobi_step
        for f in frames:
            self.next_index.fill_(1)  # a state the warm-up steps can run on: code 1 of frame f
            self.frame_base.fill_(f * self.layout.frame_stride)
            self.graphs.ensure(step, self.core.frame_key_length(f, spill=self.draft_tokens))
        torch.cuda.synchronize(self.core.device)
        return time.perf_counter() - started

    def decide_frame(self, frame: int) -> int:
        """Codes 1..T-1 of the frame in the device state; returns the steps run."""
        codes = self.layout.image_tokens
        if self.draft_tokens == 0:
            self.graphs.run(plain_step, self.core.frame_key_length(frame), codes - 1)
            return codes - 1
        self.drafts.copy_(self.previous_codes[1:1 + self.draft_tokens])
        key_length = self.core.frame_key_length(frame, spill=self.draft_tokens)
        steps = 0
        while (remaining := codes - int(self.next_index)) > 0:
            # A step decides at most K + 1 codes, so this many can never run past the frame's end:
            # the host looks at the device only a few times per frame.
            batch = math.ceil(remaining / (self.draft_tokens + 1))
            self.graphs.run(jacobi_step, key_length, batch)
            steps += batch
        return steps


class SingleStreamBackend:
    """The single-stream decoder behind the backend interface (`base.WorldModelBackend`).

    `draft_tokens=0`: plain decoding, the reference's codes for a seed (greedy and sampled).
    `draft_tokens=K`: speculative Jacobi decoding (`draft`: jacobi or previous-frame); greedy codes
    are the reference's, sampled codes follow the model's distribution exactly and repeat for a
    seed, but are not the codes plain sampling draws for that seed. `cuda_graphs`: replay each
    decode step as a CUDA graph (a CUDA device only; None: wherever the model is on CUDA).
    `quantization="fp8"`: the decode steps read fp8 copies of the layers' and lm_head's weights (one
    scale a row, terra's Triton kernel, CUDA only), an approximation of the model, opt-in.
    `kv_cache_dtype="fp8"` (or "fp8_e4m3"): keys and values kept in fp8, the queries rounded to it
    (`StaticKVDecoder(fp8_cache=True)`), an approximation, opt-in. `stats`: per
    rollout, steps, codes per step, kept drafts and per-frame seconds of the last `generate`.
    """

    name = "single-stream"

    def __init__(self, checkpoint_dir=None, *, device: str | None = None, dtype: str | None = None, model=None,
                 draft_tokens: int = 0, draft: str = "jacobi", cuda_graphs: bool | None = False,
                 quantization: str | None = None, kv_cache_dtype: str | None = None):
        from terra_cli.runtime import resolve_device, resolve_dtype

        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization: None or 'fp8' on the single-stream backend, got {quantization!r}")
        if kv_cache_dtype not in FP8_CACHE_DTYPES + (None, "auto"):
            raise ValueError(f"kv_cache_dtype: None, 'auto' or fp8 (e4m3) on the single-stream backend, "
                             f"got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype if kv_cache_dtype in FP8_CACHE_DTYPES else None

        self.quantization = quantization
        self.device = resolve_device(device)
        self.model = model if model is not None else load_model(checkpoint_dir, self.device, resolve_dtype(dtype, self.device))
        self.config = self.model.config
        if cuda_graphs is None:  # on wherever they can run
            cuda_graphs = self.model.lm_head.weight.device.type == "cuda"
        self.decoder = SingleStreamDecoder(self.model, draft_tokens=draft_tokens, draft=draft, cuda_graphs=cuda_graphs,
                                           fp8_weights=quantization == "fp8", fp8_cache=self.kv_cache_dtype is not None)
        self.stats: list[dict] = []
        self.rows = None  # the row batch's decoder, made when a driver first batches jobs

    def row_batch(self, rows: int):
        """The decoder of batches of up to `rows` rollouts (`row_batch.RowBatchDecoder`), sharing the
        single decoder's weights and compiled layers; its caches take rows x one rollout's."""
        from terra_cli.backends.row_batch import RowBatchDecoder, bucket

        if self.rows is None or self.rows.rows < bucket(rows):
            self.rows = None  # the smaller one's caches go before the larger one's are taken
            self.rows = RowBatchDecoder(self.decoder.core, bucket(rows), cuda_graphs=self.decoder.graphs.enabled)
        return self.rows

    @property
    def max_row_batch(self) -> int:
        """Rollouts a row batch takes at most: with fp8 weights, also what the few-rows kernel's tiles
        hold, since every projection of a step runs through it."""
        from terra_cli.backends.row_batch import MAX_ROWS
        from terra_cli.kernels.few_rows_matmul import MAX_ROWS as FEW_ROWS

        return min(FEW_ROWS, MAX_ROWS) if self.quantization == "fp8" else MAX_ROWS

    def warm_row_batch(self, rows: int) -> float:
        """Where steps are compiled or captured (CUDA), the row batch's every row count up to `rows`
        now rather than on the first sessions' frames (`RowBatchDecoder.warm_up`): seconds taken."""
        if rows < 2 or not (self.decoder.graphs.enabled or self.decoder.core.compiled):
            return 0.0
        return self.row_batch(rows).warm_up(Sampling())

    def generate(self, context_tokens, action_waypoints, num_frames, sampling: Sampling,
                 on_frame: FrameCallback | None = None, *, first_frame: int = 0) -> np.ndarray:
        """As `HfBackend.generate`; `first_frame`: the video frame index of the round's first
        context frame (the seed rule counts frames over the whole video)."""
        layout = self.model.layout
        context, actions = check_generation_inputs(layout, context_tokens, action_waypoints, num_frames)
        rollouts = context.shape[0]
        out = np.empty((rollouts, num_frames, layout.image_tokens), dtype=np.int64)
        self.stats = []
        report = on_frame if rollouts == 1 else None
        for r in range(rollouts):
            per_frame = None if report is None else (lambda f, frame: report(f, frame[None]))
            out[r] = self.decoder.rollout(context[r], actions[r], num_frames, sampling, rollout_seed(sampling.seed, r),
                                          first_frame, per_frame)
            self.stats.append(self.decoder.stats)
        if on_frame is not None and rollouts > 1:
            for f in range(context.shape[1], num_frames):
                on_frame(f, out[:, f])
        return out

    def driver(self, max_in_flight: int = 1, stagger_starts: bool = False):
        from terra_cli.backends.single_stream_driver import SingleStreamDriver

        return SingleStreamDriver(self, max_in_flight)  # one rollout at a time: nothing to stagger

    def auto_in_flight(self, longest_frames: int, cap: int) -> tuple[int, str]:
        return 1, "the single-stream backend runs one rollout at a time unless --max-in-flight asks for a row batch"

    def close(self) -> None:
        self.rows = None
        self.decoder = None
        self.model = None
