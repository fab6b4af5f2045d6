"""Asynchronous training: Hogwild's lock-free SGD on shared-memory parameters (Niu et al. 2011)."""

from plait.async_training.hogwild import HogwildConfig, HogwildResult, train_hogwild

__all__ = ["HogwildConfig", "HogwildResult", "train_hogwild"]
