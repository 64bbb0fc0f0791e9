"""Shared by the multi-turn sampler tests (static and continuous engines)."""

from __future__ import annotations

import numpy as np


def opening_prompts(tok, rend, openings, *, prompts: int, generations: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Each prompt's rendered opening (row ``p*K`` of ``openings``), tokenised and
    left-padded: tokens [P, Lp], mask [P, Lp] and Lp."""
    ids = [tok(rend(openings[p * generations], {}, True), add_special_tokens=False)["input_ids"]
           for p in range(prompts)]
    width = max(map(len, ids))
    tokens = np.full((prompts, width), tok.pad_token_id, np.int32)
    mask = np.zeros((prompts, width), np.int32)
    for p, row in enumerate(ids):
        tokens[p, width - len(row):], mask[p, width - len(row):] = row, 1
    return tokens, mask, width
