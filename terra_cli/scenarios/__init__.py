"""Many videos in one run: scenario files in (spec.py), continuous batching over one engine, each
finished scenario written atomically with a line in results.jsonl (runner.py)."""
