"""vLLM plugin (entry point `vllm.general_plugins`): runs in vLLM's front-end, engine core and
every worker process, which in-script registration would not reach."""

from terra_cli.models.config import ARCH_V1, ARCH_V2


def register() -> None:
    from vllm import ModelRegistry

    from terra_cli.models.config import register_auto_config

    register_auto_config()
    for arch in (ARCH_V1, ARCH_V2):
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"terra_cli.models.modeling_vllm:{arch}")
