"""Asynchronous and loosely synchronised training.

* The parameter server (Li et al. 2014, OSDI; Ho et al. 2013's stale synchronous parallel;
  Dean et al. 2012's Downpour SGD): `plait train` with `ps.servers > 0` runs it
  (plait.async_training.ps_launch).
* Hogwild's lock-free SGD on shared-memory parameters (Niu et al. 2011): `plait hogwild`, or
  `train_hogwild(HogwildConfig(...))`.
"""

from plait.async_training.hogwild import HogwildConfig, HogwildResult, train_hogwild

__all__ = ["HogwildConfig", "HogwildResult", "train_hogwild"]
