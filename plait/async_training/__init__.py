"""Asynchronous and loosely synchronised training: the parameter server (Li et al. 2014,
OSDI; Ho et al. 2013's stale synchronous parallel; Dean et al. 2012's Downpour SGD).

`plait train` with `ps.servers > 0` runs it (plait.async_training.ps_launch)."""
