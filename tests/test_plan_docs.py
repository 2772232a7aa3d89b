"""The generators behind docs/scaling.md: link fitting, the calibration table, the per-setting sections.

Pure and fast: a small plan of identical layers stands in for the three settings, which
``python -m benchmarks.throughput.scaling`` plans in full.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
from plan_helpers import uniform_profile

from fdg_schedule.plan import Cluster, Variant
from fdg_schedule.plan.overheads import Overheads
from fdg_schedule.plan.recommend import plan

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> ModuleType:
    """``benchmarks.throughput.<name>``, run afresh: a test's changes to its module state (``SHOWN``) stay its own."""
    return importlib.reload(importlib.import_module(f"benchmarks.throughput.{name}"))


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    calibration = load("plan_calibration")
    one_way = {str(size): 100e-6 + size / 3e9 for size in (4096, 65536, 1 << 20, 4 << 20)}
    latency, bandwidth = calibration.fit_link(one_way)
    assert latency == pytest.approx(100e-6) and bandwidth == pytest.approx(3e9)


def test_the_stored_calibration_renders_every_variant() -> None:
    calibration = load("plan_calibration")
    result = json.loads((ROOT / "docs" / "results" / "scaling" / "plan_calibration.json").read_text())
    text = calibration.markdown(result)
    for model in ("resnet32", "transformer"):
        assert f"**{model}**" in text
    for variant in calibration.VARIANTS:
        assert f"| {variant} |" in text


def test_a_setting_section_states_break_even_and_reading() -> None:
    scaling = load("scaling")
    profile = uniform_profile(8, step=0.1)
    setting = scaling.Setting("toy", "toy", "a toy model", lambda: profile, "A100", "h100-ib", 2, [2, 4])
    variants = [Variant("fdg"), Variant("fdg", accumulate=None), Variant("1f1b"), Variant("zbh1")]
    result = plan(profile, Cluster(gpus_per_node=4), [2, 4], variants, dp=2)
    scaling.SHOWN[:] = [v.name for v in variants]
    text = "\n".join(scaling.setting_section(setting, result) + scaling.reading(result))
    assert "Break-even: the best FDG mode that fits is ahead at K =" in text
    assert "| 4 |" in text and "FDG's throughput reaches 95% of its maximum" in text
    assert "With 2 data-parallel replicas, FDG with a step per micro-batch all-reduces" in text
    summary = "\n".join(scaling.summary([setting], {"toy": result}))
    assert summary.startswith("- **toy**: FDG's best fitting mode is ahead")


def test_a_fall_at_a_new_node_boundary_is_explained() -> None:
    scaling = load("scaling")
    profile = uniform_profile(8, act=1000.0)  # a micro-batch's activation takes 10 s between nodes
    cluster = Cluster(gpus_per_node=2, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=100.0)
    variants = [Variant("fdg"), Variant("interleaved")]
    result = plan(profile, cluster, [2, 4], variants)
    scaling.SHOWN[:] = [v.name for v in variants]
    text = "\n".join(scaling.falls(result))
    # FDG's cut between the nodes is between stages 1 and 2, whose round trip has 4 ticks of stage 1's work to
    # hide in (Note [each message when it exists]): it does not fall; interleaving crosses the nodes 3 times.
    assert text.startswith("- From K = 2 to K = 4 (1 → 2 nodes) these fall: interleaved v=2 ")
    assert "fdg" not in text.splitlines()[0].split(".")[0]
    assert "More bytes cross between nodes, through a node's 0 GB/s port rather than the 1 GB/s links" in text
    assert "interleaved v=2" in text and "at 2 x nodes - 1 cuts each way" in text
    # interleaved at K = 4 on two nodes: 3 cuts between nodes, 6 messages; each node's port sends 3 of them
    four = next(p for p in result.predictions if p.variant.schedule == "interleaved" and p.stages == 4)
    assert four.inter_node_bytes_per_micro_batch == pytest.approx(6 * 1000.0)
    assert scaling.busiest_port_s(result, four) == pytest.approx(3 * 1000.0 / 100.0)


def test_interleaving_behind_1f1b_is_explained_by_the_rank_holding_the_uncuttable_layer() -> None:
    scaling = load("scaling")
    base = uniform_profile(8, act=0.0)
    heavy = dataclasses.replace(base.layers[-1], name="Head", forward_s=4.0, backward_s=8.0)
    profile = dataclasses.replace(base, layers=(*base.layers[:-1], heavy))
    variants = [Variant("1f1b"), Variant("interleaved")]
    result = plan(profile, Cluster(gpus_per_node=8), [2], variants)
    text = "\n".join(scaling.interleaving_behind(result))
    # seconds: 7 layers of 3 and a head of 12. 1F1B cuts [0, 6, 8]: 18 and 15. Interleaved's 4 chunks
    # [0, 3, 6, 7, 8] are 9, 9, 3, 12 (none over the head), but rank 1 runs chunks 1 and 3: 21
    assert text.startswith("- Interleaved 1F1B is behind DeepSpeed's 1F1B at K = 2 (K = 2: ")
    assert "busiest rank 21000.00 vs 18000.00 ms of compute" in text and "(Head, 12000.00 ms" in text


def test_the_page_opens_with_the_answer_drawn_from_the_results() -> None:
    scaling = load("scaling")
    profile = uniform_profile(8, step=0.1)
    setting = scaling.Setting("toy", "toy", "a toy model", lambda: profile, "A100", "h100-ib", 2, [2, 4])
    variants = [Variant("fdg"), Variant("fdg", accumulate=None), Variant("1f1b"), Variant("zbh1")]
    result = plan(profile, Cluster(gpus_per_node=4), [2, 4], variants, dp=2)
    paper = {"cifar": {"wrn_28_10": {"rows": {2: {"speedup": 2.0, "paper_speedup": 1.6}}}}}
    text = "\n".join(scaling.answer([setting], {"toy": result}, paper))
    assert text.startswith("## The answer\n")
    ratios = scaling.ratios(result)
    for k in (2, 4):
        fdg, _, other = scaling.head_to_head(result, k)
        assert fdg is not None and other is not None
        assert f"| toy | {k} | {fdg.variant.name}: " in text and f"**{ratios[k]:.2f}x**" in text
        # r is not measured for an unnamed model: the net column says so and gives the break-even r
        assert f"**{ratios[k]:.2f}x** | unknown: r not measured (break-even r = {ratios[k]:.2f}) |" in text
    assert "The planner's pick: " in text and "the predicted speed-up is +25% to +25% off the published one" in text


def test_the_answers_net_column_divides_the_per_step_ratio_by_r() -> None:
    scaling = load("scaling")
    profile = uniform_profile(8, step=0.1)
    variants = [Variant("fdg", accumulate=None), Variant("1f1b")]
    result = plan(profile, Cluster(gpus_per_node=4), [4], variants, overheads=Overheads(value=1.25))
    fdg, _, other = scaling.head_to_head(result, 4)
    assert fdg is not None and other is not None
    ratio = fdg.samples_per_s / other.samples_per_s
    assert scaling._net(result, 4) == f"{ratio / 1.25:.2f}x (r = 1.25)"
