"""Load the one engine a server runs: the world model's backend and its image tokenizer."""

from __future__ import annotations

from collections.abc import Mapping

from dataclasses import dataclass, field

from terra_cli.errors import InputError
from terra_cli.server.engine import EngineService
from terra_cli.server.pictures import MAX_PICTURES

MAX_PICTURE_BATCH = MAX_PICTURES  # a padded decode holds no more than the pictures one call takes


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    variant: str = "world_model"
    tokenizer: str | None = None
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    options: Mapping = field(default_factory=dict)  # engine_request.VllmOptions from the CLI
    threads: int = 0
    max_in_flight: int = 128  # rollouts at once (sessions + video jobs); the reference batches lockstep ones
    session_slots: int = 32  # of those, kept for sessions
    picture_batch: int = 1  # frames in every picture decode, padded (--picture-batch)


def check_engine_config(config: EngineConfig):
    """Every check that needs no model; returns (model choice, its config, backend name, device)."""
    from terra_cli.pipeline.engine_request import check_backend_options, resolve_backend_name
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.resolve import resolve_model
    from terra_cli.runtime import resolve_device, resolve_dtype_name
    from terra_cli.streams import picture_stream_asked

    device = resolve_device(config.device)
    resolve_dtype_name(config.dtype, device)
    if config.max_in_flight < 1:
        raise InputError(f"--max-in-flight must be at least 1, got {config.max_in_flight}")
    backend = resolve_backend_name(config.backend, rollouts=config.max_in_flight, device=device,
                                   options=config.options)
    check_backend_options(backend, config.options, device)
    if not 1 <= config.picture_batch <= MAX_PICTURE_BATCH:
        raise InputError(f"--picture-batch must be 1 to {MAX_PICTURE_BATCH} frames, got {config.picture_batch}")
    picture_stream_asked()  # its lab switch, before minutes of loading
    choice = resolve_model(config.model, config.variant, config.tokenizer)
    model_config = load_config(choice.world_model_dir)
    if choice.tokenizer is None:
        raise InputError(f"--model {choice.label} comes without an image tokenizer, which a server needs to encode "
                         "contexts and decode frames: pass --tokenizer DIR_OR_HUB_ID")
    return choice, model_config, backend, device


def load_engine(config: EngineConfig) -> EngineService:
    from terra_cli.pipeline.world_model import Engine, load_world_model

    choice, model_config, backend_name, device = check_engine_config(config)
    world = load_world_model(choice, Engine(backend_name, device, config.dtype, config.threads, dict(config.options)),
                             max_rollouts=config.max_in_flight)
    service = EngineService(world.backend, world.tokenizer, max_in_flight=config.max_in_flight,
                            session_slots=min(config.session_slots, max(config.max_in_flight - 1, 0)),
                            model_label=choice.label, picture_batch=config.picture_batch)
    try:
        service.warm_up_pictures()
    except BaseException:
        service.close()
        raise
    return service
