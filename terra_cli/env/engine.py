"""The simulator's engine: the backend's driver (backends/driver.py) running in a background
thread on a `JobFeed`, as the server's EngineService runs it, and a blocking `run(jobs)`.

A step's N jobs are put into the feed while it holds them back, then released together: the
reference driver takes them as one lockstep batch (they have the same shape of work), vLLM's
StreamDriver admits them in one engine step, so the N next frames are one continuous batch. The
driver's run never returns while the engine is open, so vLLM's prefix cache (which StreamDriver
resets only when a run ends) keeps every environment's prefix between steps.
"""

from __future__ import annotations

import threading

import numpy as np

from terra_cli.backends.driver import JobFeed, RolloutJob


class EnvEngineError(RuntimeError):
    pass


class EnvEngine:
    def __init__(self, backend, max_in_flight: int, *, owns_backend: bool = True):
        self.backend, self.owns_backend = backend, owns_backend
        self.layout = backend.config.layout
        self.driver = backend.driver(max_in_flight)
        self._held = threading.Event()  # set while a step's jobs go in: the driver takes none yet
        self.feed = JobFeed(hold=self._held.is_set)
        self._done = threading.Condition()
        self._results: dict[str, np.ndarray | BaseException] = {}
        self.failure: BaseException | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="terra-env-engine", daemon=True)
        self._thread.start()

    @property
    def prefix_cache(self) -> tuple[int, int] | None:
        """(cached prompt tokens, prompt tokens) summed over every request so far, where the
        driver counts them (vLLM's StreamDriver); None on the reference backend."""
        cached, prompt = getattr(self.driver, "cached_tokens", None), getattr(self.driver, "prompt_tokens", None)
        return None if cached is None or prompt is None else (int(cached), int(prompt))

    def run(self, jobs: list[RolloutJob]) -> list[np.ndarray]:
        """Each job's last frame (T,), in order; all jobs enter the engine together."""
        if self.closed:
            raise EnvEngineError("the environment is closed")
        self._held.set()
        try:
            for job in jobs:
                self.feed.put(job)
        finally:
            self._held.clear()
        keys = [job.key for job in jobs]
        with self._done:
            self._done.wait_for(lambda: self.failure is not None or all(k in self._results for k in keys))
            if self.failure is not None:
                raise EnvEngineError(f"the engine failed: {self.failure}") from self.failure
            results = [self._results.pop(k) for k in keys]
        for result in results:
            if isinstance(result, BaseException):
                raise EnvEngineError(f"a frame failed: {result}") from result
        return results

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.feed.close()
        self._thread.join(timeout=120)
        if self.owns_backend:
            self.backend.close()

    def _settle(self, key: str, result) -> None:
        with self._done:
            self._results[key] = result
            self._done.notify_all()

    def _run(self) -> None:
        try:
            self.driver.run(self.feed, on_done=lambda job, tokens: self._settle(job.key, np.array(tokens[-1])),
                            on_error=lambda job, exc: self._settle(job.key, exc),
                            on_cancelled=lambda job: self._settle(job.key, EnvEngineError("cancelled")))
        except BaseException as exc:  # the engine thread reports, never dies silently
            with self._done:
                self.failure = exc
                self._done.notify_all()
