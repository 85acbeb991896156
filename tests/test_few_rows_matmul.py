"""terra's few-rows kernel (kernels/few_rows_matmul.py), run under Triton's interpreter in a process of
its own (tests/few_rows_interpreted.py): its products against float64, split-K's too, its refusals,
and a greedy Jacobi rollout of the single-stream decoder whose every decode step's logits and layer
projections it computed; then the same with fp8 weights (`quantize_rows_fp8`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from terra_cli.errors import InputError
from terra_cli.kernels import few_rows_matmul as kernel
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

pytest.importorskip("triton")
HERE = Path(__file__).parent


def test_the_few_rows_kernel_computes_the_product_and_the_reference_codes(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_vocab=64, image_tokens=40, max_frames=5),
                                       seed=1)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, str(HERE / "few_rows_interpreted.py"), str(checkpoint)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {int(case.rsplit("-", 1)[1]) for case in result["errors"]} == {1, 9, 16, 17, 32}
    assert result["tile_rows"] == [16, 16, 32, 32]  # the rows of 1, 16, 17 and 32 in one tile of each size
    for case, got in result["errors"].items():
        rows = int(case.rsplit("-", 1)[1])
        assert got["shape"] == [rows, 300], case
        # float32: the sum's rounding; bfloat16: the output's own rounding (8 bits of mantissa)
        assert got["error"] < (1e-5 if case.startswith("torch.float32") else 8e-3), (case, got)
    assert len(result["refused"]) == 4 and "1 to 32 rows" in result["refused"][0]
    assert "0 slices" in result["refused"][2] and "7 slices" in result["refused"][3]
    assert result["slices"] == {"1": 1, "2": 2, "4": 3, "6": 6}
    for splits, error in result["split_errors"].items():
        assert error < 1e-5 and result["split_repeatable"][splits], (splits, error)
    assert result["layout"] == "few-rows" and result["layers"] == "few-rows"
    assert result["kernel_rows"] == [4]  # every decode step of a K=3 Jacobi rollout has K + 1 rows
    assert result["layer_rows"] == [4]
    # four projections a layer (q, k and v as one; o; gate and up as one; down) on every decode step
    assert result["layer_calls"] == 4 * result["model_layers"] * result["logits_calls"]
    assert result["codes_equal"]
    fp8 = result["fp8"]
    assert fp8["dtypes"] == ["torch.float8_e4m3fn", "torch.float32"]
    # e4m3 keeps 3 bits of mantissa: within 2^-4 of each value (or e4m3's subnormal step, relative to the row)
    assert fp8["rounding_within_bound"] and 1e-3 < fp8["rounding_error"] < 2 ** -4 and fp8["zero_row"]
    assert {f"{rows}-{splits}" for rows in (1, 9, 32) for splits in (1, 2, 6)} <= set(fp8["errors"])
    for case, error in fp8["errors"].items():  # the product with the weights the values and scales stand for
        assert error < (8e-3 if "bf16" in case else 1e-5), (case, error)  # bf16 rows: the output's rounding
    # one row of fp8 weights is a GEMV by default (its errors are the rows=1 cases above), other calls a
    # tensor-core tile; any weights as a GEMV through a probe's tile, one slice and three
    assert fp8["fp8_one_row_tile"] is True and fp8["other_tiles"] == [False, False]
    wide, narrow = kernel.TENSOR_CORE_TILE.block_n, kernel.FP8_ROW_BATCH_TILE.block_n
    assert narrow < wide
    assert fp8["block_n_by_rows"] == {"9-fp8": wide, "9-bf16": wide, "16-fp8": wide, "16-bf16": wide,
                                      "17-fp8": narrow, "17-bf16": wide, "32-fp8": narrow, "32-bf16": wide}
    assert {case for case in fp8["errors"] if case.startswith("gemv")} == {
        f"gemv-{name}-{splits}" for name in ("fp32", "bf16", "fp8") for splits in (1, 3)}
    # TERRA_FEW_ROWS_PDL's GEMV (its first weight tile loaded before the wait) gives the same bits
    assert fp8["peeled_equal"] == {f"{name}-{splits}": True for name in ("fp32", "bf16", "fp8") for splits in (1, 3)}
    assert len(fp8["refused"]) == 3 and all("scale" in message for message in fp8["refused"])
    assert fp8["layers"] == "few-rows-fp8" and fp8["logits"] == "few-rows-fp8" and fp8["head_fp8"]
    assert fp8["scaled_calls"] == [["torch.float8_e4m3fn", True]]  # every layer projection read fp8 values
    assert fp8["scaled_logits"] == [["torch.float8_e4m3fn", True]] and fp8["logits_calls"] > 0
    assert fp8["layer_calls"] == 4 * result["model_layers"] * fp8["logits_calls"]
    assert fp8["codes_equal"]
    assert fp8["logits_20_rows_calls"] == [[20, "torch.float8_e4m3fn"]]
    assert fp8["logits_20_rows_error"] < 1e-5  # fp8 values times their scales: what the rounded weights hold
    assert fp8["row_batch_limit"] == 32  # fp8 weights' row batches stay within the kernel's larger tile
    traced = result["traced_slices"]  # the slices are in the traced graph: a cache keyed by its code tells them apart
    # 40 column blocks of the row batch's tile: 8 slices give the 528 programs; bytes caps them at 4
    assert traced["programs"]["slices"] == 8 and traced["bytes"]["slices"] == 4
    assert traced["slice_args"] == [["8"], ["4"]]  # one graph each, its operator call naming its slices
    assert traced["programs"]["error"] == 0 and traced["bytes"]["error"] == 0


def test_splits_capped_by_the_partials_bytes_only_when_asked():
    """Terra's qkv projection (2,560 x 2,048) on an H100's 528 wanted programs: 16 slices of K by default at any
    row count; with TERRA_FEW_ROWS_SPLITS=bytes, 32 rows of fp8 weights get the slices whose float32 partials
    stay within a quarter of the weight's bytes, one row keeps them all, and a bad value is one clear error."""
    from terra_cli.errors import InputError
    from terra_cli.kernels.few_rows_matmul import PARTIALS_SHARE, splits_for, splits_mode

    qkv = dict(outputs=2560, depth=2048, programs_wanted=528)
    assert splits_for(**qkv, rows=32, element_bytes=1, mode=splits_mode({})) == 16
    capped = splits_for(**qkv, rows=32, element_bytes=1, mode=splits_mode({"TERRA_FEW_ROWS_SPLITS": "bytes"}))
    assert capped == 4 and capped * 32 * 2560 * 4 <= PARTIALS_SHARE * 2560 * 2048 * 1
    assert splits_for(**qkv, rows=1, element_bytes=1, mode=splits_mode({"TERRA_FEW_ROWS_SPLITS": "bytes"})) == 16
    # down (2,048 x 5,632, 44 blocks of K): 22 slices; fp8 weights at 32 rows capped to 11 (4 blocks each), bf16
    # weights' twice the bytes leave 22 within the share
    down = dict(outputs=2048, depth=5632, programs_wanted=528, rows=32)
    assert splits_for(**down, element_bytes=1, mode=splits_mode({})) == 22
    assert splits_for(**down, element_bytes=1, mode=splits_mode({"TERRA_FEW_ROWS_SPLITS": "Bytes "})) == 11
    assert splits_for(**down, element_bytes=2, mode=splits_mode({"TERRA_FEW_ROWS_SPLITS": "bytes"})) == 22
    with pytest.raises(InputError, match="TERRA_FEW_ROWS_SPLITS"):
        splits_mode({"TERRA_FEW_ROWS_SPLITS": "all"})


def test_the_programmatic_launch_switch_takes_1_wait_or_0_only():
    assert kernel.pdl_mode({}) == "1" and kernel.pdl_mode({kernel.PDL_ENV: " 0 "}) == "0"  # on unless switched off
    assert kernel.pdl_mode({kernel.PDL_ENV: "1"}) == "1" and kernel.pdl_mode({kernel.PDL_ENV: "Wait"}) == "wait"
    with pytest.raises(InputError, match="TERRA_FEW_ROWS_PDL='yes': use 1, wait or 0"):
        kernel.pdl_mode({kernel.PDL_ENV: "yes"})
