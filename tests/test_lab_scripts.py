"""The GPU lab scripts' own bookkeeping, which decides whether a scarce device call's results come back:
`pack_out` (gpu_common.sh) and gpu_lean41.sh's checks before any setup. Bash only, no GPU."""

import os
import subprocess
import tarfile
import time

from conftest import REPO


def bash(script: str, out, **env):
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out), **env})


def members(tarball) -> set[str]:
    with tarfile.open(tarball) as packed:
        return {name.removeprefix("./") for name in packed.getnames() if name != "."}


def test_a_chain_of_packs_gives_each_its_own_files_and_keeps_older_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.log").write_text("a file from before this run")
    os.utime(out / "earlier.log", (time.time() - 60, time.time() - 60))
    # right after sourcing, within the clock's tick: the mark must still count these files as this run's
    result = bash("""source benchmarks/scripts/gpu_common.sh
        echo a > "$OUT/one-bf16.json"; mkdir "$OUT/sub"; echo b > "$OUT/sub/one.log"
        pack_out lean41-one
        echo c > "$OUT/profile-bf16.json"
        pack_out lean41-profile
        echo d > "$OUT/one-bf16.json"
        pack_out lean41-one""", out)
    assert result.returncode == 0, result.stderr
    assert members(out / "lean41-one.tgz") == {"one-bf16.json", "sub/one.log"}
    assert members(out / "lean41-profile.tgz") == {"profile-bf16.json"}
    assert members(out / "lean41-one-2.tgz") == {"one-bf16.json"}
    assert sorted(path.name for path in out.iterdir()) == [
        "earlier.log", "lean41-one-2.tgz", "lean41-one.tgz", "lean41-profile.tgz"]


def test_lean41_refuses_a_bad_chain_before_any_setup(tmp_path):
    for args, env, said in (("", {}, "usage"), ("one foo", {}, "usage"),
                            ("bench one", {"WEIGHTS": "bf16 fp9"}, "WEIGHTS: fp9"),
                            ("one pictures", {"PICTURE_ROWS": "pic4 pic3"}, "PICTURE_ROWS: pic3"),
                            ("pictures", {"PICTURE_ROWS": "tokens-vllm pic4-vllm-x"}, "PICTURE_ROWS: pic4-vllm-x")):
        result = bash(f"bash benchmarks/scripts/gpu_lean41.sh {args}", tmp_path, **env)
        assert result.returncode == 2 and said in result.stderr, (args, result.stderr)
        assert "part b" not in result.stdout  # setup never began
