"""keras_ring.torch.elastic's pieces in one process: ElasticSampler's shards, TorchState's commits.

The kill test of a whole job is in test_elastic.py.
"""

import pytest

torch = pytest.importorskip("torch")

import keras_ring.torch as hvd  # noqa: E402
from keras_ring.torch import _elastic_sampler  # noqa: E402


@pytest.fixture(autouse=True)
def _initialized():
    hvd.init()


def shards(monkeypatch, size, dataset, state=None, **options):
    """Every rank's indices in a world of `size` ranks, each from a sampler of its own."""
    every = []
    for rank in range(size):
        monkeypatch.setattr(_elastic_sampler._basics, "size", lambda: size)
        monkeypatch.setattr(_elastic_sampler._basics, "rank", lambda rank=rank: rank)
        sampler = hvd.elastic.ElasticSampler(dataset, **options)
        if state is not None:
            sampler.load_state_dict(state)
        every.append(sampler)
    return every


def test_the_sampler_shards_one_permutation_per_epoch(monkeypatch):
    samplers = shards(monkeypatch, 3, range(23), seed=5)
    indices = [list(s) for s in samplers]
    assert [len(i) for i in indices] == [8, 8, 8] == [len(s) for s in samplers]
    flat = sum(indices, [])
    assert sorted(set(flat)) == list(range(23)) and len(flat) == 24  # one index twice: padding
    assert flat != sorted(flat)  # shuffled
    again = [list(s) for s in shards(monkeypatch, 3, range(23), seed=5)]
    assert again == indices
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != indices
    plain = [list(s) for s in shards(monkeypatch, 2, range(6), shuffle=False)]
    assert plain == [[0, 2, 4], [1, 3, 5]]


def test_a_resumed_epoch_leaves_out_every_rank_s_recorded_batches(monkeypatch):
    samplers = shards(monkeypatch, 3, range(40), seed=1)
    for s in samplers:
        s.record_batch(0, 4)
        s.record_batch(1, 4)
    done = {i for s in samplers for i in list(s)[:8]}
    assert len(done) == 24
    # Each rank recorded all three ranks' batches, not only its own.
    assert all(s.processed_indices == done for s in samplers)
    resumed = shards(monkeypatch, 2, range(40), state=samplers[1].state_dict(), seed=1)
    left = [list(s) for s in resumed]
    assert [len(i) for i in left] == [8, 8]
    assert set(left[0]) | set(left[1]) == set(range(40)) - done
    assert resumed[0].get_indices(1, 4) == left[0][4:8]


def test_torch_state_goes_back_to_the_commit():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)

    def step():
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()

    step()
    state.epoch = 1
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    step()
    state.epoch = 2
    state.restore()
    assert state.epoch == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in committed.items())
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)
    # A model put in the state's place is the one kept from then on.
    other = torch.nn.Linear(3, 1)
    state.model = other
    state.save()
    saved, before = other.weight.detach().clone(), model.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1.0)
        model.weight.add_(1.0)
    state.restore()
    assert state.model is other and torch.equal(other.weight, saved)
    assert torch.equal(model.weight, before + 1.0)  # no longer kept
    with pytest.raises(TypeError, match="keeps a module"):
        state.model = 3
