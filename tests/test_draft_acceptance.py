"""The previous-frame draft acceptance probe: its math on hand-built cases, and the command end to end."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from terra_cli.bench.draft_acceptance import acceptance, expected_tokens_per_step, iid_tokens_per_step
from terra_cli.cli import app


def test_acceptance_is_the_tempered_probability_of_the_draft():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
    drafts = np.array([0, 0])
    np.testing.assert_allclose(acceptance(logits, drafts, 1.0), [0.5, 0.1])
    np.testing.assert_array_equal(acceptance(logits, drafts, 0.0), [1.0, 0.0])  # greedy: argmax or not
    sharp = acceptance(logits, drafts, 0.5)  # p^2 renormalised
    np.testing.assert_allclose(sharp, [0.25 / 0.375, 0.01 / 0.54])


def test_expected_tokens_per_step_by_hand():
    accept = np.array([[1.0, 0.5, 0.0, 1.0]])
    # k=2: start 0: 1 + 1 + 0.5; start 1: 1 + 0.5 + 0; start 2: 1 + 0 + 0; start 3: 1 + 1 (frame ends)
    assert expected_tokens_per_step(accept, 2) == (2.5 + 1.5 + 1 + 2) / 4
    assert expected_tokens_per_step(np.zeros((2, 5)), 8) == 1.0
    assert iid_tokens_per_step(0.5, 2) == 1.75 and iid_tokens_per_step(1.0, 4) == 5.0


@pytest.mark.slow
def test_command_on_the_embedded_model(tmp_path):
    out, png = tmp_path / "acc.json", tmp_path / "acc.png"
    result = CliRunner().invoke(app, ["bench", "--draft-acceptance", "--seeds", "1", "--frames", "3",
                                      "--device", "cpu", "--out", str(out), "--heatmap", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for t in ("0.9", "0.0"):
        d = data["temperatures"][t]
        assert 0 <= d["mean_acceptance"] <= 1 and np.array(d["acceptance_grid"]).shape == (18, 32)
        steps = [d["tokens_per_step"][str(k)] for k in range(1, 17)]
        assert steps == sorted(steps) and 1 <= steps[0] <= 2  # more drafts never lower the expectation
    assert 0 <= data["true_next_frame_repeats_previous"] <= 1 and png.stat().st_size > 1000
    bad = CliRunner().invoke(app, ["bench", "--draft-acceptance", "--temperatures", "nan", "--device", "cpu"])
    assert bad.exit_code == 2 and "--temperatures" in bad.output
