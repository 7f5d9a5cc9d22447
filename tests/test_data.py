import torch

from workbench.data import Digits, Synthetic, eval_shard


def test_eval_shards_cover_dataset_in_order_without_padding():
    for n, w in [(10, 3), (2, 3), (100, 4)]:
        parts = [list(eval_shard(n, r, w)) for r in range(w)]
        assert sum(parts, []) == list(range(n))


def test_embedded_datasets():
    train, ev = Digits("train"), Digits("eval")
    assert len(train) + len(ev) == 1797
    assert train.tensors[0].shape[1] == 64 and float(train.tensors[0].max()) <= 1.0
    s = Synthetic(size=100, seed=0)
    assert torch.equal(s.tensors[0], Synthetic(size=100, seed=0).tensors[0])
