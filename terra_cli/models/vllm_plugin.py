"""vLLM plugin (entry point `vllm.general_plugins`): runs in vLLM's front-end, engine core and
every worker process, which in-script registration would not reach.

The classes are registered as objects, not as "module:Class" strings: for a string vLLM inspects
the class in a subprocess the first time (about 28 s of a cold start on the H100 host, until
VLLM_CACHE_ROOT/modelinfos holds the answer; benchmarks/README.md, start-up)."""

from terra_cli.models.config import ARCH_V1, ARCH_V2


def register() -> None:
    from vllm import ModelRegistry

    from terra_cli.models import vllm_cpu_fixes
    from terra_cli.models.config import register_auto_config
    from terra_cli.models.draft_vllm import DRAFT_ARCHITECTURES, PreviousFrameDraft
    from terra_cli.models.modeling_vllm import LlamaActionForCausalLM, LlamaActionV2ForCausalLM

    register_auto_config()
    models = [(ARCH_V1, LlamaActionForCausalLM), (ARCH_V2, LlamaActionV2ForCausalLM)]
    models += [(arch, PreviousFrameDraft) for arch in DRAFT_ARCHITECTURES]
    for arch, cls in models:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, cls)
    _register_attention()
    vllm_cpu_fixes.apply()


def _register_attention() -> None:
    """terra's decode attention under vLLM's CUSTOM backend name (a path: imported only when an
    engine asks for it, on a GPU). Releases without the registry cannot use --attention terra."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:
        return
    register_backend(AttentionBackendEnum.CUSTOM, "terra_cli.models.vllm_attention.TerraAttentionBackend")
