"""What a bench reports beside its rate: how busy each GPU was (NVML) and where an engine loop's
time went (`backends.driver.LoopTimes`), as numbers and as one line for the log.

`bench.scenarios.TimedRun` reports with them, for its own bench and for `bench.act_bench`, so a
figure in one report reads the same as in the other.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

BUSY_BUCKET_S = 10.0  # the GPU busy timeline's resolution in the reports


class BusySampler:
    """Mean NVML utilization ('percent of time a kernel was running') of each GPU, sampled every
    100 ms between start() and stop(). None where NVML is unavailable (CPU runs)."""

    def __init__(self, gpus: list[int], interval: float = 0.1):
        self.gpus, self.interval = gpus, interval
        self.samples: dict[int, list[int]] = {g: [] for g in gpus}
        self.times: list[float] = []  # seconds since the first sample, one per round of samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terra-busy-sampler", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = {g: pynvml.nvmlDeviceGetHandleByIndex(g) for g in self.gpus}
        except Exception:  # no NVML (CPU, or the package is missing): busy stays unknown
            return
        first = time.perf_counter()
        while not self._stop.is_set():
            for g, handle in handles.items():
                self.samples[g].append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            self.times.append(time.perf_counter() - first)
            time.sleep(self.interval)

    def busy_after(self, first: int) -> list[float]:
        """Each GPU's mean busy fraction over its samples from index `first` on (empty without NVML)."""
        return [float(np.mean(s[first:])) / 100 for s in self.samples.values() if len(s) > first]

    def busy(self) -> dict[str, float | None]:
        return {str(g): (round(float(np.mean(s)) / 100, 3) if s else None) for g, s in self.samples.items()}

    def timeline(self, bucket_s: float = BUSY_BUCKET_S) -> dict[str, list[float]]:
        """Busy fraction of each GPU per `bucket_s` seconds, in order: a steady dip and one phase
        of the run (a round's start, the end's drain) look alike in the mean, not here."""
        buckets = (np.asarray(self.times) // bucket_s).astype(int)
        timeline = {}
        for g, s in self.samples.items():
            values, owners = np.asarray(s[:len(buckets)], dtype=float), buckets[:len(s)]
            if values.size:
                timeline[str(g)] = [round(float(values[owners == b].mean()) / 100, 3) if (owners == b).any() else None
                                    for b in range(int(owners.max()) + 1)]
        return timeline


def gpu_indices(device: str, workers: int) -> list[int]:
    """NVML indices of the GPUs the engines run on (CUDA_VISIBLE_DEVICES order)."""
    if not device.startswith("cuda"):
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [int(v) for v in visible.split(",") if v.strip().isdigit()] if visible else list(range(workers))
    if device.startswith("cuda:"):
        return [ids[int(device.split(":")[1])]] if ids else [int(device.split(":")[1])]
    return ids[:workers]


def busy_while(device: str, run):
    """(run(), the mean busy share NVML gave the GPU `device` names while it ran); the share is None on a CPU
    or without NVML. Sampled every 50 ms: a rollout's frames are a second or so each."""
    gpus = gpu_indices(device, 1)
    sampler = BusySampler(gpus, interval=0.05)
    sampler.start()
    try:
        result = run()
    finally:
        sampler.stop()
    return result, (sampler.busy().get(str(gpus[0])) if gpus else None)


# An engine loop's values that are no running sums: a minute's line leaves them out (the run's last says them)
NOT_CUMULATIVE = ("ms_per_step", "decode_first_batch_s", "mean_in_flight", "full_after_s", "intake_done_after_s",
                  "intake_first_batch_fed_s",
                  "refiner_compiled_apart_s", "refiner_compile_s", "refiner_vae_compile_s", "decode_sms",
                  "decoder_compiled_apart_s", "decode_first_batch_cache", "refiner_compile_cache", "decode_after",
                  "decode_late_first_s", "decode_late_first_cache")


def loop_since(loop: dict, earlier: dict | None) -> dict:
    """An engine loop's times between two of its cumulative snapshots (`LoopTimes.as_dict`)."""
    earlier = earlier or {}
    # (a value still None in the earlier snapshot, such as the refiner's wall before its first video, counts from 0)
    since = {k: v - (earlier.get(k) or 0) for k, v in loop.items()
             if k not in NOT_CUMULATIVE and isinstance(v, (int, float))}
    since["ms_per_step"] = 1000 * since["in_engine_step_s"] / since["steps"] if since.get("steps") else None
    if since.get("rollout_steps") and since.get("steps"):
        since["mean_in_flight"] = since["rollout_steps"] / since["steps"]
        since["full_after_s"] = loop.get("full_after_s")
    return since


def cache_counts(counts: list[int] | None) -> str:
    """A compile's FX-graph lookups, as " (Inductor's cache: H hits, M misses)"; empty when it made none."""
    if not counts or not any(counts):
        return ""
    return f" (Inductor's cache: {counts[0]} hits, {counts[1]} misses)"


def describe_engine_loop(loop: dict | None) -> str | None:
    """One line on where the engine loop's time went (`backends.driver.LoopTimes`), for the log."""
    if not loop or not loop.get("seconds"):
        return None
    share = {k: 100 * loop.get(k, 0.0) / loop["seconds"]
             for k in ("in_engine_step_s", "admitting_jobs_s", "handling_frames_s", "idle_s")}
    idle = f", {share['idle_s']:.0f}% idle (nothing in flight, waiting for work)" if loop.get("idle_s") else ""
    steps = f"{loop['ms_per_step']:.2f} ms x {loop['steps']} steps" if loop.get("ms_per_step") is not None else "no step"
    if loop.get("mean_in_flight") is not None:  # continuous batching: how full the batch ran
        full = loop.get("full_after_s")
        steps += f", {loop['mean_in_flight']:.0f} in flight on average, "
        if loop.get("rollout_steps"):  # KV-bound steps take the same per rollout at any batch (benchmarks/README.md)
            steps += f"{1e6 * loop['in_engine_step_s'] / loop['rollout_steps']:.1f} us a rollout-step, "
        steps += "the slots were never all held" if full is None else f"every slot held first after {full:.1f} s"
    waits = ""
    if loop.get("wakes"):  # a Ray actor's WakeProbe: a thread of the engine's process sleeping 5 ms at a time
        waits = (f"; its process's 5 ms timer woke {1000 * loop['wake_late_s'] / loop['wakes']:.2f} ms late on average, "
                 f"{100 * loop.get('wake_long_waits', 0) / loop['wakes']:.0f}% of wakes over 2 ms late")
    stages = ""  # what the writer's decode-ahead and the intake did beside the loop
    if loop.get("decode_ahead_batches"):  # the in-process writer's decode-ahead (scenarios.frame_store.FrameStore)
        stages = (f"; the writer decoded {loop['decode_ahead_frames']} frames ahead in "
                   f"{loop['decode_ahead_batches']} batches")
        if loop.get("decode_ahead_timed_frames"):  # beside the engine's steps: how much of the card it held
            stages += f" ({1000 * loop['decode_ahead_s'] / loop['decode_ahead_timed_frames']:.2f} ms a frame)"
        if loop.get("decoder_compiled_apart_s") is not None:  # scenarios.decoder_compile_apart
            stages += f", compiled apart first in {loop['decoder_compiled_apart_s']:.1f} s"
        if loop.get("decode_first_batch_s") is not None:  # its compile here: from the child's cache only if no miss
            stages += f", its first batch {loop['decode_first_batch_s']:.1f} s{cache_counts(loop.get('decode_first_batch_cache'))}"
    if loop.get("decode_late_frames"):
        stages += (f"; {loop['decode_late_frames']} frames decoded when their video was done "
                   f"({loop.get('decode_late_s', 0.0):.1f} s")
        if loop.get("decode_late_first_s") is not None:  # nothing decoded before: the decoder's compile in it
            if not loop.get("decode_ahead_batches") and loop.get("decoder_compiled_apart_s") is not None:
                stages += f"; the decoder compiled apart first in {loop['decoder_compiled_apart_s']:.1f} s"
            stages += (f"; the first video {loop['decode_late_first_s']:.1f} s, the decoder's compile in it"
                       f"{cache_counts(loop.get('decode_late_first_cache'))}")
            if loop.get("decode_late_timed_frames"):
                stages += f"; then {1000 * loop['decode_late_timed_s'] / loop['decode_late_timed_frames']:.2f} ms a frame"
        if loop.get("decode_filled_frames"):  # FrameStore.take: other videos' frames in those batches' padding
            stages += f", with {loop['decode_filled_frames']} frames of other videos in the same batches"
        if loop.get("decode_held_limit"):  # held_frames.held_frames_for: frames past it wait for their video's end
            stages += f"; {loop['decode_held_limit']} frames held ahead at most"
        stages += ")"
    if loop.get("decode_after"):  # --videos-at-end
        stages += "; every video decoded once the engine was done (--videos-at-end)"
    if loop.get("feed_held_s"):  # the job feed's hold: free slots left empty while the writer was behind
        stages += f"; new jobs held back {loop['feed_held_s']:.1f} s (the writer behind)"
    if loop.get("refined_videos") is not None:  # --decoder refiner: the engine's refiner stage (refiner.stage)
        stages += (f"; the refiner made {loop['refined_videos']} videos in {loop['refiner_unet_batches']} UNet "
                   f"batches, its thread busy {loop['refiner_busy_s']:.1f} s")
        if loop.get("refiner_compiled_apart_s") is not None:
            stages += f", compiled apart first in {loop['refiner_compiled_apart_s']:.1f} s"
        if loop.get("refiner_compile_cache") is not None:
            stages += f", compiled here in {loop.get('refiner_compile_s', 0.0):.1f} s{cache_counts(loop['refiner_compile_cache'])}"
        if loop.get("refiner_wall_s") and loop["refined_videos"]:  # refiner.stage.RefineStage.wall_s
            stages += (f"; {loop['refiner_wall_s']:.1f} s from its first UNet batch to its last video "
                       f"({loop['refiner_wall_s'] / loop['refined_videos']:.2f} s a video)")
        if loop.get("refiner_unet_s") is not None:  # its parts (refiner.stage), and what ran beside the thread
            stages += (f"; its thread's parts: taking videos in {loop['refiner_take_in_s']:.1f} s, "
                       f"UNet {loop['refiner_unet_s']:.1f} s, VAE decoding {loop['refiner_vae_decode_s']:.1f} s; "
                       f"waiting for videos {loop['refiner_starved_s']:.1f} s, "
                       f"mp4s {loop['refiner_mp4_s']:.1f} s in its encoder threads")
    if loop.get("intake_read_wait_s") is not None:  # a single engine's intake (scenarios.encoding.EncodeAhead)
        done = loop.get("intake_done_after_s")
        stages += (f"; the intake waited {loop.get('intake_read_wait_s', 0.0):.1f} s for reads and encoded "
                    f"{loop['intake_encode_s']:.1f} s" + ("" if done is None else f", all taken in after {done:.1f} s"))
    elif loop.get("intake_encode_s") is not None:  # a Ray engine's intake thread (its contexts read by the driver)
        fed = loop.get("intake_first_batch_fed_s")
        stages += (f"; the intake encoded {loop['intake_encode_s']:.1f} s"
                   + ("" if fed is None else f", its first batch of jobs fed {fed:.1f} s after the engine was ready"))
    return (f"engine loop: {share['in_engine_step_s']:.0f}% in the engine's step ({steps}), "
            f"{share['admitting_jobs_s']:.0f}% taking in jobs, "
            f"{share['handling_frames_s']:.0f}% handling finished frames{idle}{waits}{stages}")
