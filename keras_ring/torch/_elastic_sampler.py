"""ElasticSampler: a `DistributedSampler` that resumes an epoch where an elastic job left it."""

import torch

from keras_ring.core import _basics


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the ranks of the world now, skipping what the epoch has done.

    Horovod's `hvd.elastic.ElasticSampler`. Each epoch draws one permutation
    of the dataset (from `seed + epoch`, the same on every rank), leaves out
    the indices recorded as processed, pads what is left to a multiple of
    the world's size and gives rank `r` every `size`-th index from `r`. Give
    it to a `TorchState` (`TorchState(model, optimizer, sampler=sampler)`):
    a commit keeps the indices processed so far, and after a reset, on the
    re-formed world, the epoch goes on with those left, split over the new
    ranks.

    `record_batch(i, batch_size)` records batch `i` of every rank, not of
    this rank only (each rank knows the whole permutation): the indices a
    lost worker had processed by the last commit are not processed again.
    Horovod's sampler records each rank's own indices, so a lost worker's
    batches of the epoch are done twice.

    Args:
        dataset: A dataset with `len()`.
        shuffle: Whether each epoch permutes the indices (default `True`).
        seed: The permutation's seed, plus the epoch (default 0).

    Example:

    ```python
    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for i, (x, y) in enumerate(loader):
                ...
                state.sampler.record_batch(i, 32)
                if i % 10 == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()
    ```
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch `epoch`: its own permutation, nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Records batch `batch_idx` (of `batch_size` indices per rank) of every rank as processed.

        Batches count from the start of this world's pass over the epoch,
        as `enumerate(loader)` does.
        """
        for rank in range(self.num_replicas):
            self.processed_indices.update(self._batch_of(rank, batch_idx, batch_size))

    def record_indices(self, indices):
        """Records dataset indices as processed (this rank's own; a sync joins every rank's)."""
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx, batch_size):
        """This rank's indices of batch `batch_idx`."""
        return self._batch_of(self.rank, batch_idx, batch_size)

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self):
        """Shards what is left of the epoch over the world now (its rank and size)."""
        self.num_replicas, self.rank = _basics.size(), _basics.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(order), generator=generator).tolist()
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_samples = -(-len(remaining) // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        # Padded with the first indices again, so that every rank has num_samples.
        self._padded = remaining + [remaining[i % len(remaining)]
                                    for i in range(self.total_size - len(remaining))]

    def _batch_of(self, rank, batch_idx, batch_size):
        start = batch_idx * batch_size
        stop = min(start + batch_size, self.num_samples)
        return [self._padded[rank + j * self.num_replicas] for j in range(start, stop)]

    def __iter__(self):
        return iter(self._padded[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples
