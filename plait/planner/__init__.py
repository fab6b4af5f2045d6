"""`plait plan`: choose a layout automatically (Alpa, Zheng et al. 2022), from a cost model built of
plait's own formulas (Narayanan et al. 2021 for FLOPs and tensor/pipeline communication).

cluster.py (`load_cluster`: a preset, this machine or a file; the records and presets in
hardware.py, the file format in cluster_file.py), cost.py (one layout's time and memory), stages.py (Alpa's
inter-operator DP; the pipeline through plait's simulator), search.py (enumerate, prune, rank),
calibrate.py (`plait plan --calibrate`: this machine measured as the cluster `this`), auto.py
(`plait train --parallel.plan auto`), diloco.py (DiLoCo's outer exchange, `plait plan --diloco H`).
"""

from plait.planner.cluster import PRESETS, Cluster, Link, load_cluster
from plait.planner.cost import Candidate, evaluate
from plait.planner.search import plan
from plait.planner.stages import brute_force_stages, inter_op_dp

__all__ = [
    "PRESETS",
    "Cluster",
    "Candidate",
    "Link",
    "brute_force_stages",
    "evaluate",
    "inter_op_dp",
    "load_cluster",
    "plan",
]
