"""Embedded text corpora and the deterministic distributed sampler that feeds them to training."""

from plait.data.corpus import Corpus, load_corpus
from plait.data.sampler import DistributedBatchSampler, eval_batches

__all__ = ["load_corpus", "Corpus", "DistributedBatchSampler", "eval_batches"]
