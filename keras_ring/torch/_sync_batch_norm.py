"""Batch normalization over the global batch: Horovod's `SyncBatchNorm`, on CPU tensors."""

import torch
import torch.nn.functional as F

from keras_ring.core._process_sets import global_process_set
from keras_ring.torch import _ops


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """`BatchNorm` whose training statistics are those of every rank's batch together.

    In training, each rank's count, mean and sum of squared deviations per
    channel are gathered and combined exactly (Chan's formula, which keeps
    the precision a sum of squares would lose), so N ranks at batch b
    normalize as one `BatchNorm` at batch N*b, gradients included (the
    gather is differentiable). In evaluation it uses its running statistics,
    as `torch.nn.BatchNorm*d` does. Takes `(N, C, ...)` input of any rank.

    Args:
        num_features: The channels, `C`.
        eps: Added to the variance for stability.
        momentum: The running statistics' update factor; `None` for a
            cumulative average.
        affine: Whether the layer has a learnable scale and shift.
        track_running_stats: Whether it keeps running statistics (without
            them it normalizes with the batch's in evaluation too).
        process_set: The ranks whose batches form the global batch.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"keras_ring.torch.SyncBatchNorm expects (N, C, ...) input of at "
                             f"least 2 dimensions. Received: {input.dim()}D input")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        mean, var, count = self._global_statistics(input)
        if self.training and self.track_running_stats:
            self._update_running_statistics(mean.detach(), var.detach(), count)
        shape = (1, -1) + (1,) * (input.dim() - 2)
        output = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output

    def _global_statistics(self, input):
        """The mean and biased variance per channel over every rank's batch, and its size."""
        dims = [0, *range(2, input.dim())]
        count = input.numel() // input.shape[1]
        if count:
            local_mean = input.mean(dims)
            local_m2 = ((input - local_mean.view(1, -1, *[1] * (input.dim() - 2))) ** 2).sum(dims)
        else:  # an empty batch on this rank adds nothing
            local_mean = input.new_zeros(input.shape[1])
            local_m2 = input.new_zeros(input.shape[1])
        local = torch.cat([input.new_full((1,), float(count)), local_mean, local_m2]).unsqueeze(0)
        every = _ops.allgather(local, process_set=self.process_set)
        channels = input.shape[1]
        counts, means, m2s = every[:, :1], every[:, 1:1 + channels], every[:, 1 + channels:]
        total = counts.sum().detach()
        if float(total) == 0:
            raise ValueError("keras_ring.torch.SyncBatchNorm received empty batches on every "
                             "rank: there are no statistics to normalize with.")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        return mean, m2 / total, int(total)

    def _update_running_statistics(self, mean, var, count):
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
            unbiased = var * count / max(count - 1, 1)
            self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
