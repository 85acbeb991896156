"""Speculative Jacobi decoding (the SJD family): several exact codes per decode step.

One step feeds the last decided code plus a window of K draft codes for the next positions, in one
forward, and gets the model's distribution at each of the K + 1 positions. Drafts are checked in
order with the speculative-sampling rule for a deterministic draft (the draft's distribution q is
a point mass, so min(1, p(x)/q(x)) = p(x)):

- draft x at a position whose prefix is all decided: keep it with probability p(x);
- at the first rejection, draw from p with x removed and renormalised (the residual
  normalize(max(0, p - q)) for a point mass), and stop;
- if every draft is kept, draw one more code from p at the position after the window.

Each decided code is then distributed exactly as p given the codes before it, whatever the drafts
were, as long as a draft depends only on draws already made (it does: the last iteration's samples,
or the previous frame). So the output distribution is the model's, at every temperature and filter.
What is NOT kept is the seeded stream of plain sampling: the same seed gives the same codes from
run to run of this decoder (the draws come from the same per-frame generators), but not the codes
plain decoding draws for that seed. Greedy decoding keeps a draft when it is the argmax, so greedy
codes equal plain greedy codes.

Drafts (`draft`):
- `jacobi`: the window's positions that were not decided keep the codes this step sampled for
  them (from a prefix that may have been wrong: a Jacobi iteration); positions new to the window
  take the previous frame's code at the same position;
- `previous-frame`: always the previous frame's codes at the same positions.

The window never crosses the frame's action slots: draft rows past the frame's last code are fed
(fixed shapes for CUDA graphs) but never kept, and the action slots are fed afterwards by the
step that closes the frame, which overwrites whatever those rows wrote into the cache.
"""

from __future__ import annotations

import torch

from terra_cli.backends.device_sampling import filtered_probabilities, greedy_codes, race_sample

DRAFTS = ("jacobi", "previous-frame")
MAX_DRAFT_TOKENS = 32


def jacobi_step(decoder, key_length: int) -> None:
    """One verifying step on `decoder`'s device state (single_stream.SingleStreamDecoder); no host
    sync, so it can be captured as a CUDA graph. A step after the frame's last code changes nothing
    of the frame (its rows go to the sink past the frame's codes)."""
    layout, sampling = decoder.layout, decoder.sampling
    codes_per_frame = layout.image_tokens
    k = decoder.draft_tokens
    window = decoder.window  # arange(k + 1)
    next_index = decoder.next_index  # (1,): index in the frame of the first code this step decides
    fed = torch.cat([decoder.last_token, decoder.drafts])
    positions = decoder.frame_base + next_index - 1 + window
    logits = decoder.core.forward_codes(fed, positions, key_length)  # row j predicts code next_index + j

    real = next_index + window[:k] < codes_per_frame  # draft j is a code of this frame
    padded_drafts = torch.cat([decoder.drafts, decoder.drafts[:1]])  # row k has no draft
    if sampling.greedy:
        choice = greedy_codes(logits, layout)
        kept = (choice[:k] == decoder.drafts) & real
    else:
        probabilities = filtered_probabilities(logits, layout, sampling)
        uniform = torch.rand(k, generator=decoder.generator, device=probabilities.device)
        draft_probability = probabilities[:k].gather(1, decoder.drafts[:, None])[:, 0]
        kept = (uniform < draft_probability) & real
    run = kept.long().cumprod(0).sum()  # drafts kept, 0-dim
    if not sampling.greedy:
        # The row of the first rejected draft draws from p without that draft; the row after a
        # fully kept window (the bonus) and the stale rows draw from p as it is.
        rejected_row = (window == run) & (run < real.sum())
        at_draft = probabilities.gather(1, padded_drafts[:, None])
        probabilities = probabilities.scatter(1, padded_drafts[:, None], at_draft * (~rejected_row)[:, None])
        choice = race_sample(probabilities, decoder.generator)

    own_code = choice.gather(0, run[None])
    values = torch.where(window < run, padded_drafts, own_code)
    keep = (window <= run) & (next_index + window < codes_per_frame)
    # Rows not kept go to a sink past the frame's codes: one fixed-shape write, no branch.
    targets = torch.where(keep, next_index + window, codes_per_frame + window)
    decoder.frame_codes.index_copy_(0, targets, values)
    decided = torch.minimum(run + 1, codes_per_frame - next_index)
    decoder.accepted.add_(run)
    next_index.add_(decided)
    decoder.last_token.copy_(decoder.frame_codes.gather(0, next_index - 1))

    ahead = next_index + window[:k]
    previous = decoder.previous_codes.gather(0, ahead.clamp(max=decoder.previous_codes.shape[0] - 1))
    if decoder.draft == "jacobi":
        stale_row = run + 1 + window[:k]
        stale = choice.gather(0, stale_row.clamp(max=k))
        decoder.drafts.copy_(torch.where(stale_row <= k, stale, previous))
    else:
        decoder.drafts.copy_(previous)
