"""Embedded datasets (text corpora; scikit-learn's bundled digits images, an optional extra) and
the deterministic distributed sampler that feeds them to training."""

from plait.data.corpus import Corpus, load_corpus
from plait.data.digits import load_digits_dataset
from plait.data.sampler import DistributedBatchSampler, eval_batches

__all__ = ["load_corpus", "Corpus", "DistributedBatchSampler", "eval_batches", "load_digits_dataset"]
