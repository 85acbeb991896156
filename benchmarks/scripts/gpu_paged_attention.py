"""Lab probe (issue 28): terra's paged decode kernel against the copy rate and FlashAttention-3.

Terra's attention shapes (32 query heads over 4 KV heads of 64, pages of 16 tokens), a decode
step's 22 attention calls captured in one CUDA graph over distinct caches (cycled, so nothing sits
in L2), timed by replaying it. Cases: 1 to 256 rollouts with contexts spread over a 25-frame round
(1,746..14,550 tokens, mean about 8,150), a step with two prompt tails beside 254 decodes, one
rollout early and late in a video, and a 512-token prompt tail (the largest a captured step runs
through the kernel). For each, the plan `decode_plan` chooses (and a few others); every variant
is checked against a float64 reference first. FA3 (vLLM's build) runs too when vLLM's bundle is
on PYTHONPATH.

    python3 benchmarks/scripts/gpu_paged_attention.py --out $OUT/paged_attention.json [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from terra_cli.kernels import paged_attention as pd  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 32, 4, 64, 16, 22
SCALE = HEAD_DIM ** -0.5
FP8 = torch.float8_e4m3fn


def log(*args):
    print(*args, flush=True)


def copy_rate() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


class Case:
    def __init__(self, name: str, lengths: list[int], dtype: torch.dtype, caches: int, seed: int = 0,
                 query_lens: list[int] | None = None):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.name, self.dtype = name, dtype
        self.lengths = lengths
        self.batch = len(lengths)
        self.query_lens = query_lens or [1] * self.batch
        pages = [math.ceil(n / PAGE) for n in lengths]
        total = sum(pages)
        width = max(pages)
        order = torch.randperm(total, device="cuda", generator=gen).int()
        self.block_table = torch.zeros(self.batch, width, dtype=torch.int32, device="cuda")
        used = 0
        for i, count in enumerate(pages):
            self.block_table[i, :count] = order[used:used + count]
            used += count
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        self.query_start = torch.tensor([0] + list(itertools.accumulate(self.query_lens)), dtype=torch.int32,
                                        device="cuda")
        self.tokens = sum(self.query_lens)
        self.caches = []
        for _ in range(caches):
            kv = torch.randn(total, 2, PAGE, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
            self.caches.append(kv.to(dtype) if dtype != torch.bfloat16 else kv)
        self.query = torch.randn(self.tokens, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.query)
        self.kv_bytes = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * torch.empty((), dtype=dtype).element_size()
        one = torch.ones(1, device="cuda", dtype=torch.float32)
        self.k_scale, self.v_scale, self.q_scale = one, one, one

    def reference(self, seqs: list[int]) -> tuple[list[int], torch.Tensor]:
        """(query rows, reference) for these sequences."""
        key, value = self.caches[0].unbind(1)
        rows, outs = [], []
        starts = self.query_start.tolist()
        for seq in seqs:
            n = self.query_lens[seq]
            sub_start = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            outs.append(pd.paged_attention_reference(self.query[starts[seq]:starts[seq] + n], key, value,
                                                     self.block_table[seq:seq + 1], self.seq_lens[seq:seq + 1],
                                                     sub_start, scale=SCALE).cpu())
            rows += list(range(starts[seq], starts[seq] + n))
        return rows, torch.cat(outs)


def time_graph(step, replays: int = 20) -> float:
    """Median ms of one replay of a graph holding LAYERS calls of `step(layer)`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(3):
            step(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            step(layer)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


WORKSPACE = None


def terra_step(case: Case, plan, decode_only: bool = False):
    global WORKSPACE
    WORKSPACE = WORKSPACE or pd.make_workspace(HEADS, KV_HEADS, HEAD_DIM, "cuda")

    def step(layer: int):
        key, value = case.caches[layer % len(case.caches)].unbind(1)
        pd.paged_attention(case.query, key, value, case.block_table, case.seq_lens, case.query_start, case.out,
                           scale=SCALE, k_scale=case.k_scale, v_scale=case.v_scale, plan=plan, workspace=WORKSPACE,
                           decode_only=decode_only)
    return step


def fa3_step(case: Case):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    fp8 = case.dtype == FP8
    query = case.query.to(FP8) if fp8 else case.query
    descale = case.k_scale.expand(case.batch, KV_HEADS) if fp8 else None
    max_len = max(case.lengths)

    def step(layer: int):
        key, value = case.caches[layer % len(case.caches)].unbind(1)
        flash_attn_varlen_func(q=query, k=key, v=value, out=case.out, cu_seqlens_q=case.query_start,
                               max_seqlen_q=max(case.query_lens),
                               seqused_k=case.seq_lens, max_seqlen_k=max_len, softmax_scale=SCALE, causal=True,
                               block_table=case.block_table, fa_version=3, q_descale=descale, k_descale=descale,
                               v_descale=descale)
    return step


def check(case: Case, step, seqs: int) -> float:
    """Relative error of the first `seqs` sequences' rows and every prompt's rows (NaN: a row unwritten)."""
    case.out.fill_(float("nan"))
    step(0)
    torch.cuda.synchronize()
    chosen = sorted(set(range(min(seqs, case.batch))) | {i for i, n in enumerate(case.query_lens) if n > 1})
    rows, ref = case.reference(chosen)
    got = case.out[rows].double().cpu()
    if torch.isnan(got).any():
        return float("nan")
    return float((got - ref).norm() / ref.norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows: list[dict] = []
    started = time.time()
    props = torch.cuda.get_device_properties(0)
    rate = copy_rate()
    log(f"{props.name}, {props.multi_processor_count} SMs; copy rate {rate / 1e12:.2f} TB/s (read + write)")
    try:
        fa3_step  # noqa: B018
        import vllm.vllm_flash_attn  # noqa: F401
        have_fa3 = True
    except Exception as error:  # noqa: BLE001
        log(f"FA3 not available: {error!r}")
        have_fa3 = False

    def record(case: Case, variant: str, ms: float, err: float, **extra):
        gbps = case.kv_bytes * LAYERS / (ms / 1e3) / 1e9
        row = dict(case=case.name, variant=variant, ms_per_step=round(ms, 4), kv_gb_per_step=round(case.kv_bytes * LAYERS / 1e9, 3),
                   gb_per_s=round(gbps, 1), share_of_copy=round(gbps * 1e9 / rate, 3), rel_err=err, **extra)
        rows.append(row)
        log(json.dumps(row))
        Path(args.out).write_text(json.dumps({"device": props.name, "copy_rate": rate, "rows": rows}, indent=1))

    gen = torch.Generator().manual_seed(1)

    def spread(n: int) -> list[int]:  # contexts spread over a 25-frame round, as in a continuous run
        return torch.randint(1746, 14551, (n,), generator=gen).tolist()

    sms = props.multi_processor_count
    tails = spread(256)
    tails[:2] = [14000, 13000]
    # (name, contexts, dtype, query lengths, variants beside the plan chosen)
    cases = [("256 spread fp8", spread(256), FP8, None, ("decode-only", "half", "double")),
             ("256 spread fp8 + 2 prompt tails of 22", tails, FP8, [22, 22] + [1] * 254, ()),
             ("128 spread fp8", spread(128), FP8, None, ()), ("64 spread fp8", spread(64), FP8, None, ()),
             ("32 spread fp8", spread(32), FP8, None, ()), ("8 spread fp8", spread(8), FP8, None, ("half", "double")),
             ("1 early fp8", [1746], FP8, None, ()), ("1 late fp8", [13968], FP8, None, ()),
             ("1 prompt tail of 512 after 8148 fp8", [8660], FP8, [512], ()),
             ("256 spread bf16", spread(256), torch.bfloat16, None, ()), ("1 late bf16", [13968], torch.bfloat16, None, ())]
    if args.quick:
        cases = cases[:2]
    for name, lengths, dtype, query_lens, extra in cases:
        case = Case(name, lengths, dtype, caches=8 if len(lengths) > 16 else 64, query_lens=query_lens)
        blocks = case.tokens // 2 + case.batch
        chosen = pd.decode_plan(case.batch, KV_HEADS, sms, blocks)
        variants = [("chosen", chosen, False)]
        if "decode-only" in extra:
            variants.append(("decode-only", pd.decode_plan(case.batch, KV_HEADS, sms), True))
        for label, factor in (("half", 0.5), ("double", 2)):
            if label in extra and 1 <= int(chosen.splits * factor) <= pd.MAX_SPLITS:
                variants.append((label, pd.DecodePlan(chosen.program, int(chosen.splits * factor), chosen.tile), False))
        for label, plan, decode_only in variants:
            variant = f"{label}: {plan.program} s{plan.splits} w{plan.warps} st{plan.stages} t{plan.tile}"
            try:
                step = terra_step(case, plan, decode_only)
                err = check(case, step, 8)
                record(case, variant, time_graph(step), err, program=plan.program, splits=plan.splits,
                       tile=plan.tile, chosen=label == "chosen", decode_only=decode_only)
            except Exception as error:  # noqa: BLE001
                log(f"{case.name} {variant}: {error!r}")
        if have_fa3:
            try:
                step = fa3_step(case)
                err = check(case, step, 8)
                record(case, "FA3", time_graph(step), err)
            except Exception as error:  # noqa: BLE001
                log(f"{case.name} FA3: {error!r}")
        del case
        torch.cuda.empty_cache()
    log(f"wall {time.time() - started:.0f} s")
    best = {}
    for row in rows:
        if row["case"] not in best or row["ms_per_step"] < best[row["case"]]["ms_per_step"]:
            best[row["case"]] = row
    log("| case | chosen plan | ms/step (22 calls) | share of copy | best variant | ms | FA3 ms | FA3 share |")
    for name, row in best.items():
        fa3 = next((r for r in rows if r["case"] == name and r["variant"] == "FA3"), None)
        chosen = next((r for r in rows if r["case"] == name and r.get("chosen")), {})
        log(f"| {name} | {chosen.get('variant', '-')} | {chosen.get('ms_per_step', '-')} | "
            f"{chosen.get('share_of_copy', '-')} | {row['variant']} | {row['ms_per_step']} | "
            f"{fa3['ms_per_step'] if fa3 else '-'} | {fa3['share_of_copy'] if fa3 else '-'} |")


if __name__ == "__main__":
    main()
