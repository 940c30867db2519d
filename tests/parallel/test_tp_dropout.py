"""Dropout under tensor parallel: each tp rank draws its shard's masks from a stream of its own (real
processes on gloo, the built-in GPT split by its own plan)."""

import json

from helpers import WORKERS, ok


def test_tp_ranks_draw_different_dropout_masks_for_their_shards_and_draw_them_again_alike(warm_torchrun, tmp_path):
    ok(warm_torchrun(WORKERS / "tp_dropout.py", tmp_path, nproc=2))
    rank0, rank1 = json.loads((tmp_path / "masks.json").read_text())
    for name in ("drop", "h.0.mlp.dropout"):  # the embedding's (sequence shard) and a residual's
        assert 0 < sum(rank0["own"][name]) < len(rank0["own"][name])  # dropout did drop, not everything
        # without their own streams both ranks repeat one pattern over different positions: the defect
        assert rank0["shared"][name] == rank1["shared"][name]
        assert rank0["own"][name] != rank1["own"][name]
        assert rank0["own"][name] == rank0["own_again"][name]  # the same seed draws the same masks
        assert rank1["own"][name] == rank1["own_again"][name]
        assert rank0["own"][name] == rank0["shared"][name]  # tp rank 0 keeps one process's stream
        # a model that does not say its dropout acts on shards keeps one stream for all its tp ranks
        assert rank0["not_said"][name] == rank1["not_said"][name]
