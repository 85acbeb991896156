"""What starting ffmpeg costs a big process's other threads: CPython forks the whole process when
Popen gets a Python pre-exec hook (imageio's writer passes preexec_fn=os.setpgrp) and spawns it
(vfork) otherwise (`process_group=0`, what terra's `media.frames._encode_h264` passes).

A thread writes across a heap of --gib GiB (as an engine's host side touches its memory) while the
main thread starts --spawns short processes each way; prints the spawns' time and the writing
thread's longest stall. CPU only: run it anywhere (python benchmarks/scripts/spawn_stall.py)."""

import argparse
import os
import subprocess
import threading
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--spawns", type=int, default=20)
    args = parser.parse_args()
    heap = np.ones(int(args.gib * 1024**3) // 8)
    for hook in (True, False, True, False):
        stop, gaps = threading.Event(), []

        def writer():
            where = np.random.default_rng(0).integers(0, heap.size, 4096)
            last = time.perf_counter()
            while not stop.is_set():
                heap[where] += 1.0
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        thread = threading.Thread(target=writer)
        thread.start()
        time.sleep(0.3)
        first, start = len(gaps), time.perf_counter()
        for _ in range(args.spawns):
            kwargs = {"preexec_fn": os.setpgrp} if hook else {"process_group": 0}
            subprocess.Popen(["true"], **kwargs).wait()
        seconds = time.perf_counter() - start
        stop.set()
        thread.join()
        stalls = np.array(gaps[first:])
        print(f"{'preexec_fn=os.setpgrp' if hook else 'process_group=0':22s} {args.spawns} spawns in {seconds:.2f} s "
              f"({1000 * seconds / args.spawns:.1f} ms each); the writing thread's longest stall {1000 * stalls.max():.1f} ms")


if __name__ == "__main__":
    main()
