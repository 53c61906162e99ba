"""The train step (all ranks): micro-batches, per-token tensors, loss composition, the
metric accumulator, the optimizer step."""
