"""The planner: choose each MFC's sub-mesh, parallel degrees and micro-batches for a cluster.

Modules, bottom up: `cluster` (what a cluster is), `profile` (a model in numbers), `experiment`
(graph + models + workload), `choice` (a plan), `cost` and `memory` (the analytic models: MFC
time, parameter movements, bytes per device), `simulator` (ReaL's Algorithm 1), `evaluate`
(scoring with caches), `space` (legal choices), `search` (baselines, annealing, exhaustive),
`allocation` (a plan before all its micro-batches are known, and its text), `report`. The
planner is pure and sits below the run stack; its command line, `python -m jaxrlhf.plan`, is the
entry point `jaxrlhf/plan_cli.py` (`__main__.py` here only forwards to it).
"""

from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import Cluster, load_cluster
from jaxrlhf.plan.experiment import Experiment, Workload
from jaxrlhf.plan.search import SearchOptions, SearchReport, search

__all__ = [
    "CallChoice", "Cluster", "ExecutionPlan", "Experiment", "SearchOptions", "SearchReport",
    "Workload", "load_cluster", "search",
]
