"""Sampling on the device, with no host round trip: the reference's rule, step by step.

`filtered_probabilities` and `race_sample` are `backends.hf.sample_next` split in two, op for op,
so that a generator seeded the same way draws the same codes (tests/test_single_stream.py checks
this against `sample_next` itself). The exponential race (argmax of p / Exp(1)) draws a code with
probability p using one noise tensor and one argmax, both fixed-shape kernels a CUDA graph holds.
"""

from __future__ import annotations

import functools

import torch

from terra_cli.backends.base import Sampling
from terra_cli.backends.layer_ops import EagerFallback
from terra_cli.backends.step_compile import launch_options
from terra_cli.models.config import FrameLayout
from terra_cli.runtime import choice_switch, whole_number_switch
from terra_cli.seeds import draw_seed

# TERRA_SINGLE_STREAM_SAMPLER=eager keeps a decode step's sampling eager where the step's layer functions are
# compiled (to compare).
SAMPLER_ENV = "TERRA_SINGLE_STREAM_SAMPLER"
# A row batch's rows draw their noise on NOISE_STREAMS CUDA streams of their own, parallel branches of the
# step's CUDA graph. One row's draw (262,144 exponentials from its own generator) is a kernel too small to fill
# the card, and 32 of them one after another took 0.14 ms of a 2.67 ms 32-row step on an H100 (2026-12-07c).
# Each row still draws from its own generator, the same numbers in the same order: only which draws overlap
# changes. On 4 streams, 32 sessions in the driver 0.611 -> 0.622 frames/s each (an H100, 2026-12-07d).
# TERRA_NOISE_STREAMS=N sets N (1: one stream, as before).
NOISE_STREAMS_ENV = "TERRA_NOISE_STREAMS"
NOISE_STREAMS = 4
# The race's argmax over each row's 262,144 scores goes through SAMPLER_CHUNKS equal slices, then the best
# slice (`first_argmax`: the same index). Compiled as one argmax, it was one program a row: 32 rows kept 32 of
# an H100's 132 SMs busy for 0.10 ms of a 2.67 ms step (2026-12-07c), and one row one SM. With 64 slices
# (an H100, 2026-12-07d, the same codes): 32 sessions 0.611 -> 0.626 frames/s each, one rollout with fp8
# weights 0.842 -> 0.818 s a frame (each pair in one call). TERRA_SAMPLER_CHUNKS=N sets N (1: the plain argmax).
SAMPLER_CHUNKS_ENV = "TERRA_SAMPLER_CHUNKS"
SAMPLER_CHUNKS = 64


def filtered_probabilities(logits: torch.Tensor, layout: FrameLayout, sampling: Sampling) -> torch.Tensor:
    """Rows of logits (R, >= V) -> the probabilities (R, V) the reference samples from (not greedy)."""
    logits = logits[:, : layout.image_vocab_size].float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def greedy_codes(logits: torch.Tensor, layout: FrameLayout) -> torch.Tensor:
    return logits[:, : layout.image_vocab_size].float().argmax(dim=-1)


def race_sample(probabilities: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One code per row of (R, V) probabilities; draws R * V exponentials from `generator`."""
    race = torch.empty_like(probabilities).exponential_(generator=generator)
    return (probabilities / race).argmax(dim=-1)


def first_argmax(scores: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """scores (R, V).argmax(-1), the first of equal maxima; with `chunks` > 1 dividing V, through each of that
    many equal slices' max first (its first index), then the first slice holding the row's max: the same
    index, from a reduction of R x chunks outputs instead of R."""
    rows, width = scores.shape
    if chunks <= 1 or width % chunks:
        return scores.argmax(dim=-1)
    best, where = scores.view(rows, chunks, width // chunks).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk * (width // chunks) + where.gather(-1, chunk)).squeeze(-1)


def race_codes(logits: torch.Tensor, noise: torch.Tensor, layout: FrameLayout, sampling: Sampling,
               chunks: int = 1) -> torch.Tensor:
    """Codes (R,) from logits (R, >= V) and each row's noise (R, V) already drawn: `race_sample`'s rule
    (`chunks`: `first_argmax`'s, the same codes)."""
    return first_argmax(filtered_probabilities(logits, layout, sampling) / noise, chunks)


class StepSampler(EagerFallback):
    """`race_codes` for the decode steps, through torch.compile where `compiled` (the step's layer functions
    are): eager, the sampler makes about eight passes over (rows, 262,144) floats, some of them one
    thread block a row (softmax, argmax), a share of a 32-row step that grows with the rows. A failed
    compile (on the warm-up step, before any graph capture) leaves it eager; `error` says why."""

    def __init__(self, compiled: bool, environ=None):
        super().__init__()
        eager = choice_switch(SAMPLER_ENV, ("compiled", "eager"), "compiled (the default) or eager", environ) == "eager"
        # read here, not in the trace: the slices then stand in the traced graph (and Inductor's cache key)
        self.chunks = whole_number_switch(SAMPLER_CHUNKS_ENV, 4096, "a whole number of slices from 1 to 4096",
                                          environ) or SAMPLER_CHUNKS
        self.race = functools.partial(race_codes, chunks=self.chunks)
        self.compiled = (torch.compile(self.race, dynamic=False, fullgraph=True, options=launch_options() or None)
                         if compiled and not eager else None)

    def __call__(self, logits: torch.Tensor, noise: torch.Tensor, layout: FrameLayout,
                 sampling: Sampling) -> torch.Tensor:
        return self.call(self.compiled, self.race, logits, noise, layout, sampling)


def noise_stream_count(environ=None) -> int:
    """How many streams a row batch's noise draws spread over: NOISE_STREAMS, or NOISE_STREAMS_ENV's count."""
    return whole_number_switch(NOISE_STREAMS_ENV, 32, "a whole number of streams from 1 to 32", environ) or NOISE_STREAMS


def noise_streams(device: torch.device, environ=None) -> list:
    """The CUDA streams for a row batch's noise draws on `device` (`noise_stream_count`); none on other devices
    or for a count of 1."""
    count = noise_stream_count(environ)
    if count < 2 or device.type != "cuda":
        return []
    return [torch.cuda.Stream(device=device) for _ in range(count)]


def draw_noise(noise: torch.Tensor, generators: list[torch.Generator], streams: list = ()) -> None:
    """noise[i] <- Exp(1) draws from generators[i], row by row; with `streams` (`noise_streams`), the rows
    spread over them, forked from and joined back to the current stream (so a CUDA graph captures them as
    parallel branches)."""
    if len(streams) < 2 or len(generators) < 2:
        for row, generator in zip(noise, generators):
            row.exponential_(generator=generator)
        return
    current = torch.cuda.current_stream(noise.device)
    for stream in streams:
        stream.wait_stream(current)
    for index, (row, generator) in enumerate(zip(noise, generators)):
        with torch.cuda.stream(streams[index % len(streams)]):
            row.exponential_(generator=generator)
    for stream in streams:
        current.wait_stream(stream)


def draw_codes(logits: torch.Tensor, layout: FrameLayout, sampling: Sampling, generators: list[torch.Generator],
               noise: torch.Tensor, race=race_codes, streams: list = ()) -> torch.Tensor:
    """Each row's next code from logits (R, >= V): greedy, or row i's noise drawn from generators[i] into
    noise[i] (the draws `race_sample` takes for that row alone; on `streams`, see `draw_noise`) and the rows
    raced by `race` (`race_codes`, or a `StepSampler`). `noise`: at least R rows of V floats, overwritten."""
    if sampling.greedy:
        return greedy_codes(logits, layout)
    noise = noise[:len(generators)]
    draw_noise(noise, generators, streams)
    return race(logits, noise, layout, sampling)


def next_codes(logits: torch.Tensor, layout: FrameLayout, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The reference's `sample_next` for one rollout's rows of logits."""
    if sampling.greedy:
        return greedy_codes(logits, layout)
    return race_sample(filtered_probabilities(logits, layout, sampling), generator)


class FrameGenerators:
    """The seed rule (terra_cli/seeds.py): frame `f` of the rollout seeded `s` is drawn from a
    generator seeded `draw_seed(s, first_frame + f)`. The one generator object is reseeded at each
    frame's start, so a CUDA graph that registered it keeps drawing from the right stream."""

    def __init__(self, generator: torch.Generator, rollout_seed: int, first_frame: int = 0):
        self.generator = generator
        self.rollout_seed = rollout_seed
        self.first_frame = first_frame

    def start_frame(self, frame: int) -> torch.Generator:
        self.generator.manual_seed(draw_seed(self.rollout_seed, self.first_frame + frame))
        return self.generator
