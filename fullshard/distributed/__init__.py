"""torch.distributed plumbing: counted collectives and the (replicate, shard) mesh."""
