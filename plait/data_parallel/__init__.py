"""Data parallelism: bucketed, overlapped gradient all-reduce (Li et al. 2020)."""

from plait.data_parallel.ddp import DataParallel, GradBucket, allreduce_mean_hook

__all__ = ["DataParallel", "GradBucket", "allreduce_mean_hook"]
