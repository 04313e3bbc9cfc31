"""The scheduler process: request table, block manager, continuous-batching policy."""
