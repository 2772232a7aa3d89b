"""The planner: predicts what FDG and the other pipeline schedules do at K = 2 ... 64 on a cluster, and recommends one.

    python -m fdg_schedule.plan --model resnet101 --gpu A100 --micro-batch 32 --cluster a100-100gbe

From per-layer costs (a profile JSON, a trace, or a FLOP estimate for a named GPU) and a cluster,
each schedule's per-rank instruction stream is simulated event by event; see docs/scaling.md.

Modules: :mod:`~fdg_schedule.plan.costs` (what a layer costs), :mod:`~fdg_schedule.plan.flops`
(estimates), :mod:`~fdg_schedule.plan.cluster` (links and placement), :mod:`~fdg_schedule.plan.streams`
(schedules as action lists), :mod:`~fdg_schedule.plan.simulate` (the simulator),
:mod:`~fdg_schedule.plan.split` (where to cut), :mod:`~fdg_schedule.plan.predict` (one prediction),
:mod:`~fdg_schedule.plan.recommend` (all of them, and the pick, by time to the same loss),
:mod:`~fdg_schedule.plan.token_overhead` (the token overhead r, measured from validation curves),
:mod:`~fdg_schedule.plan.overheads` (where the planner gets r: yours, the shipped table, or unknown).
"""

from fdg_schedule.plan.cluster import CLUSTERS, Cluster, Placement
from fdg_schedule.plan.costs import LayerCost, ModelProfile, load_profile, profile_from_trace
from fdg_schedule.plan.flops import GPUS, TRANSFORMERS, Efficiency, estimate_resnet, estimate_transformer
from fdg_schedule.plan.predict import CostModel, Infeasible, Prediction, Variant, backprop, default_variants, predict
from fdg_schedule.plan.simulate import ChunkCosts, Link, Timeline, simulate

__all__ = [
    "CLUSTERS",
    "GPUS",
    "TRANSFORMERS",
    "ChunkCosts",
    "Cluster",
    "CostModel",
    "Efficiency",
    "Infeasible",
    "LayerCost",
    "Link",
    "ModelProfile",
    "Placement",
    "Prediction",
    "Timeline",
    "Variant",
    "backprop",
    "default_variants",
    "estimate_resnet",
    "estimate_transformer",
    "load_profile",
    "predict",
    "profile_from_trace",
    "simulate",
]
