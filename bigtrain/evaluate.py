"""The validation loss (``train.eval_every``): the mean next-token loss over the held-out windows of
``data.val_fraction``, or of the corpus ``data.val_source``, forward only, in whatever layout the run trains.

Each data-parallel rank takes its rows of every validation batch, as in training; the loss sums go
through the same reductions as the training loss (the pipeline's last stage to every stage, then
the replicas), and are divided by the count of targets over all the windows: so every layout gives
one process's value. Under pipeline parallelism the micro-batches pass the stages one after the
other (blocking sends; no schedule is needed without a backward). Nothing here changes the model:
no gradients are kept, and the MoE blocks' routing statistics (which update the router biases
after each step) are put back as they were.
"""

from __future__ import annotations

from typing import Callable

import torch

from bigtrain.data.sampler import TokenSampler
from bigtrain.models.moe import routing_statistics_set_aside
from bigtrain.parallel.parallel_model import ParallelModel
from bigtrain.parallel.pipeline.executor import _encode_spec, _recv_spec


@torch.no_grad()
def held_out_loss(parallel: ParallelModel, sampler: TokenSampler, batches: int, dp_rank: int, dp: int,
                  micro_batch: int, to_device: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The mean loss over ``batches`` validation global batches; collective over the whole mesh."""
    loss_sum = torch.zeros((), device=parallel.device)
    with routing_statistics_set_aside(parallel.model):
        for tokens, targets in sampler.eval_micro_batches(batches, dp_rank, dp, micro_batch):
            tokens, targets, kwargs = parallel.model_inputs(to_device(tokens), to_device(targets))
            if parallel.schedule is None:
                out = parallel.model(tokens, **kwargs)
                loss_sum += parallel.loss_sum(out, targets).float()
            else:
                loss_sum += _through_the_stages(parallel, tokens, targets, kwargs)
    if parallel.schedule is not None:
        parallel.pp.all_reduce(loss_sum, tag="metrics")  # the last stage's sum, to every stage
    parallel.grad_comm.all_reduce(loss_sum, tag="metrics")
    return float(loss_sum) / sampler.eval_targets(batches)


def _through_the_stages(parallel: ParallelModel, tokens: torch.Tensor, targets: torch.Tensor,
                        kwargs: dict) -> torch.Tensor:
    """One micro-batch forward through every pipeline stage in order; its summed loss on the rank of
    the last stage, 0 elsewhere. Each hand-over to another rank sends the shape first."""
    schedule, pp, device = parallel.schedule, parallel.pp, parallel.device
    h, loss = tokens, torch.zeros((), device=device)
    for stage in range(schedule.num_stages):
        here = schedule.rank_of_stage(stage)
        before = schedule.rank_of_stage(stage - 1) if stage else here
        if here != pp.rank:
            if before == pp.rank:  # this rank ran the previous stage: hand its output over
                pp.send(_encode_spec(h, device), here, tag="meta")
                pp.send(h.contiguous(), here, tag="activations")
            continue
        if before != pp.rank:
            shape, dtype = _recv_spec(pp, before, device)
            h = torch.empty(shape, dtype=dtype, device=device)
            pp.recv(h, before)
        h = parallel.stages[stage](h, **kwargs)
    if (schedule.num_stages - 1) in parallel.stages:
        loss = parallel.loss_sum(h, targets).float()
    return loss
