"""A loaded world model: the engine (a backend), the image tokenizer, the config, loaded once.

Its life is the caller's, not one video's: `terra generate` loads it for one video and closes it,
a scenario run or a Ray engine actor loads it once for thousands of videos, the server and the
simulator keep it for as long as they run. Every front-end loads through `load_world_model`, so
the model, the tokenizer check against the model's codes, the device, the dtype and the engine's
size are resolved the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import time
from dataclasses import dataclass, field

from terra_cli.errors import InputError
from terra_cli.models.resolve import ModelChoice


@dataclass(frozen=True)
class Engine:
    """How to run the world model: backend (auto, hf, vllm), device, dtype, CPU threads (the
    reference's), and the backend's own options (vLLM engine arguments, from `engine_request.engine_options`)."""

    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    options: Mapping = field(default_factory=dict)


@dataclass
class WorldModel:
    backend: object  # backends.WorldModelBackend: generate rounds, or `driver(n)` for jobs
    tokenizer: object | None  # the image tokenizer, or None where nothing is encoded or decoded
    config: object  # models.config.LlamaActionConfig
    choice: ModelChoice
    device: str
    load_seconds: float = 0.0
    tokenizer_seconds: float = 0.0

    @property
    def layout(self):
        return self.config.layout

    @property
    def startup(self) -> dict:
        """The engine's start-up in phases (vLLM; empty for the reference)."""
        return dict(getattr(self.backend, "startup", None) or {})

    def driver(self, max_in_flight: int = 1, stagger_starts: bool = False):
        return self.backend.driver(max_in_flight, stagger_starts)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def __enter__(self) -> "WorldModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_world_model(choice: ModelChoice, engine: Engine = Engine(), *, needs_tokenizer: bool = True,
                     max_rollouts: int = 1, gpu_share: float | None = None,
                     between=lambda tokenizer, options: None) -> WorldModel:
    """Load the tokenizer (checked against the model's codes) and then the engine. `max_rollouts`:
    rollouts the engine runs at once; `gpu_share`: its share of the GPU's memory where something
    else shares the card; `between(tokenizer, options)` runs between the two loads (the refiner
    loads there and takes its share of the GPU first)."""
    from terra_cli.backends import load_backend
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.resolve import load_tokenizer
    from terra_cli.pipeline.engine_request import check_backend_options, resolve_backend_name
    from terra_cli.runtime import resolve_device, resolve_dtype_name

    device = resolve_device(engine.device)
    resolve_dtype_name(engine.dtype, device)
    name = resolve_backend_name(engine.backend, rollouts=max_rollouts, device=device, options=engine.options)
    check_backend_options(name, engine.options, device)
    config = load_config(choice.world_model_dir)
    if needs_tokenizer and choice.tokenizer is None:
        raise InputError(f"--model {choice.label} comes without an image tokenizer: pass --tokenizer DIR_OR_HUB_ID")
    tokenizer, tokenizer_seconds = None, 0.0
    if needs_tokenizer:
        started = time.perf_counter()
        tokenizer = load_tokenizer(choice.tokenizer, device, matching=config)
        tokenizer_seconds = time.perf_counter() - started
    options = dict(engine.options)
    between(tokenizer, options)
    if gpu_share is not None:
        options.setdefault("gpu_share", gpu_share)
    started = time.perf_counter()
    backend = load_backend(name, choice.world_model_dir, device=device, dtype=engine.dtype, max_rollouts=max_rollouts,
                           threads=engine.threads, **options)
    return WorldModel(backend, tokenizer, config, choice, device, time.perf_counter() - started, tokenizer_seconds)
