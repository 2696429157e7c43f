"""Sequence packing: samples concatenated into rows of up to ``max_seq_len`` tokens.

Each document in a pack keeps its own positions (restarting at 0) and attends only to
itself, so a packed row computes what its documents would compute one by one; the
first label of every document is dropped so no document learns to predict the next.
"""

from __future__ import annotations

import torch

from ckptkit.train.samples import IGNORE_INDEX, Sample


def pack(samples: list[Sample], max_seq_len: int) -> list[Sample]:
    """Samples, in order, greedily filled into packs of at most ``max_seq_len`` tokens."""
    packs: list[Sample] = []
    current = Sample([], [], [])
    for s in samples:
        if current.ids and len(current.ids) + len(s.ids) > max_seq_len:
            packs.append(current)
            current = Sample([], [], [])
        current.ids += s.ids
        current.labels += [IGNORE_INDEX, *s.labels[1:]]
        current.lengths.append(len(s.ids))
    if current.ids:
        packs.append(current)
    return packs


def document_inputs(lengths: list[list[int]], width: int) -> dict[str, torch.Tensor]:
    """``position_ids`` (B, T) restarting per document and a block-causal mask (B, 1, T, T).

    Padding after the documents forms one more block, so every query sees at least itself.
    """
    doc = torch.zeros((len(lengths), width), dtype=torch.long)
    positions = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, docs in enumerate(lengths):
        start = 0
        for d, n in enumerate([*docs, width - sum(docs)]):
            doc[row, start : start + n] = d
            positions[row, start : start + n] = torch.arange(n)
            start += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return {"position_ids": positions, "document_mask": mask[:, None]}
