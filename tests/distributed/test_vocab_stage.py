"""The pipeline with its first stage's embedding table split by rows (distributed/vocab_stage.py): one 2-rank gloo
spawn on 127.0.0.1 runs tiny BERT's two time-balanced stages over 4 microbatches and gives the single-process
outputs exactly, each rank holding its half of the word embeddings (slow: ~15 s of start-up per launch); the
refusal of a first stage without a plain embedding runs in process."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
from conftest import bert_inputs, make_tiny_bert
from vocab_stage_worker import run_rank

from fxforge import ForgeGraph
from fxforge.distributed.vocab_stage import RowShard, VocabStageError, row_range, split_stage_embedding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_split_table_pipeline_equals_one_process(tmp_path: Path) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg.export(tmp_path / "ckpt")
    inputs = bert_inputs(vocab=100, batch=8, seq=11, labels=False)
    inputs["input_ids"][0, :4] = torch.tensor([0, 49, 50, 99])  # both ends of both ranks' rows
    with torch.no_grad():
        reference = mg(**inputs)
    torch.save({"inputs": inputs}, tmp_path / "io.pt")
    ctx = mp.start_processes(run_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the split-embedding pipeline did not finish within 240 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = torch.load(tmp_path / "out.pt")
    logits = reference.logits if hasattr(reference, "logits") else reference
    got = out[0] if isinstance(out, tuple | list) else out
    assert torch.equal(got, logits)  # exact: one rank holds each id's row, the others add zeros
    table = mg.model.get_submodule("bert.embeddings.word_embeddings").weight
    for rank in range(2):
        held = torch.load(tmp_path / f"held{rank}.pt")
        start, stop = held["rows"]
        assert (start, stop) == (50 * rank, 50 * rank + 50)
        assert torch.equal(held["weight"], table[start:stop])


def test_row_shard_looks_up_its_rows_and_zeros_the_rest() -> None:
    table = nn.Embedding(7, 3)
    ids = torch.tensor([[0, 3, 4, 6], [5, 2, 1, 0]])
    parts = [RowShard(table, *row_range(7, r, 2)) for r in range(2)]
    assert [(p.start, p.stop) for p in parts] == [(0, 4), (4, 7)]
    with torch.no_grad():
        assert torch.equal(parts[0](ids) + parts[1](ids), table(ids))
        assert torch.equal(parts[1](ids)[0, :2], torch.zeros(2, 3))


def test_a_first_stage_without_a_plain_embedding_is_refused() -> None:
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m0 = nn.Linear(3, 3)

    with pytest.raises(VocabStageError, match="calls no nn.Embedding"):
        split_stage_embedding(Stage(), 0, 2, None)
