"""`terra bench --refiner`: the refiner alone at each windows-per-call (terra_cli/bench/refiner.py), printed and
saved as JSON."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

from terra_cli.cli.app import out
from terra_cli.cli.bench import parse_batches


def refiner_bench(windows: str, compile_mode: str, refiner_dtype: str, full_cfg: bool, plain_cross_attention: bool,
                   tiny: bool, device: str, dtype: str, seed: int, out_json: Optional[Path], overwrite: bool) -> None:
    from terra_cli.bench.refiner import RefinerBenchPlan, run_refiner_bench
    from terra_cli.media.atomic import atomic_write_json, check_writable
    from terra_cli.refiner.config import TERRA_REFINER, tiny_refiner_config
    from terra_cli.refiner.refiner import RefinerOptions
    from terra_cli.runtime import resolve_device, resolve_dtype

    if out_json is not None:
        check_writable(out_json, overwrite)
    batches = parse_batches(windows, "--windows", "windows per call like 1,2")
    resolved = resolve_device(device)
    from terra_cli.refiner.fp8 import check_fp8_device, check_refiner_dtype

    if check_refiner_dtype(refiner_dtype) == "fp8":
        check_fp8_device(resolved)
    options = RefinerOptions(same_uncond=not full_cfg, batch_windows=max(batches), compile=compile_mode,
                             exact_cross_attention=not plain_cross_attention, dtype=refiner_dtype.strip().lower())
    plan = RefinerBenchPlan(batches=batches, options=options, device=resolved, dtype=resolve_dtype(dtype, resolved),
                            config=tiny_refiner_config() if tiny else TERRA_REFINER)
    import torch

    torch.manual_seed(seed)
    result = run_refiner_bench(plan, say=lambda line: out.print(line, highlight=False, soft_wrap=True))
    result["command"] = shlex.join(["terra", *sys.argv[1:]])
    if out_json is not None:
        atomic_write_json(out_json, result, overwrite=overwrite)
        out.print(f"results -> {out_json}", highlight=False)
