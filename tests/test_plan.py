"""The planner's parts around the simulator: placement and links, splits, profiles, estimates, predictions."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from plan_helpers import uniform_profile

from fdg_schedule.plan import (
    CLUSTERS,
    GPUS,
    TRANSFORMERS,
    Cluster,
    CostModel,
    Infeasible,
    Placement,
    Variant,
    estimate_resnet,
    estimate_transformer,
    load_profile,
    predict,
    profile_from_trace,
)
from fdg_schedule.plan.cluster import parse_bandwidth, parse_size, parse_time
from fdg_schedule.plan.costs import profile_to_dict
from fdg_schedule.plan.recommend import plan
from fdg_schedule.plan.split import best_split

# -- cluster ------------------------------------------------------------------------------------------


def test_ranks_are_pipe_major_like_deepspeeds_topology() -> None:
    p = Placement(Cluster(gpus_per_node=4), stages=4, dp=2)
    assert [p.rank(s, d) for s in range(4) for d in range(2)] == list(range(8))
    assert [p.node(s) for s in range(4)] == [0, 0, 1, 1]
    assert not p.crosses_nodes(0, 1) and p.crosses_nodes(1, 2)
    assert p.senders_sharing_nic(1) == 2  # both replicas of stage 1 send to node 1 at once


def test_a_message_between_nodes_shares_the_nic_and_one_inside_uses_its_own_link() -> None:
    c = Cluster(gpus_per_node=4, intra_bandwidth=100.0, intra_latency=1.0, inter_bandwidth=10.0, inter_latency=5.0)
    p = Placement(c, stages=4, dp=2)
    assert p.transfer_s(0, 1, 50.0) == (0.5, 1.0, False)
    assert p.transfer_s(1, 2, 50.0) == (10.0, 5.0, True)  # 50 bytes x 2 replicas / 10 B/s


def test_ring_allreduce_time() -> None:
    c = Cluster(gpus_per_node=8, intra_bandwidth=100.0, intra_latency=0.5, inter_bandwidth=20.0, inter_latency=2.0)
    inside = Placement(c, stages=2, dp=4)  # each stage's 4 replicas on one node
    assert inside.allreduce_s(0, 400.0) == pytest.approx(2 * 3 / 4 * 400 / 100 + 2 * 3 * 0.5)
    across = Placement(c, stages=1, dp=16)  # one stage over two nodes: one ring leaves each node
    assert across.allreduce_s(0, 400.0) == pytest.approx(2 * 15 / 16 * 400 / 20 + 2 * 15 * 2.0)
    assert Placement(c, stages=4, dp=1).allreduce_s(0, 400.0) == 0.0


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [(parse_bandwidth, "100Gb/s", 12.5e9), (parse_bandwidth, "25GB/s", 25e9), (parse_bandwidth, "800Mbit/s", 1e8),
     (parse_size, "80GB", 80e9), (parse_size, "2GiB", 2**31), (parse_time, "5us", 5e-6), (parse_time, "0.1ms", 1e-4)],
)  # fmt: skip
def test_units(parse, text: str, value: float) -> None:  # type: ignore[no-untyped-def]
    assert parse(text, "--flag") == pytest.approx(value)


def test_bad_units_name_the_flag_and_an_example() -> None:
    with pytest.raises(ValueError, match=r"--inter-bandwidth '100 Gbps' is not a bandwidth; write e.g. 100Gb/s"):
        parse_bandwidth("100 Gbps", "--inter-bandwidth")
    with pytest.raises(ValueError, match=r"--memory-limit 'lots' is not a size; write e.g. 80GB"):
        parse_size("lots", "--memory-limit")


def test_a_cluster_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="gpus_per_node must be an integer >= 1, got 0"):
        Cluster(gpus_per_node=0)
    with pytest.raises(ValueError, match="inter_bandwidth must be > 0"):
        Cluster(inter_bandwidth=0)


# -- split --------------------------------------------------------------------------------------------


def test_best_split_minimises_the_slowest_stage() -> None:
    costs = [1, 1, 1, 1, 4, 1, 1, 1, 1]
    bounds = best_split(len(costs), 3, lambda a, b, k: sum(costs[a:b]))
    assert bounds is not None and max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == 4
    brute = min(
        max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:]))
        for i in range(1, len(costs))
        for j in range(i + 1, len(costs))
    )
    assert brute == 4


def test_best_split_respects_the_memory_limit_per_stage_position() -> None:
    # Stage 0 may hold at most one layer: the balanced 2,2 split would not fit.
    bounds = best_split(4, 2, lambda a, b, k: b - a, memory=lambda a, b, k: (b - a) * (3 if k == 0 else 1), limit=3)
    assert bounds == [0, 1, 4]
    assert best_split(4, 2, lambda a, b, k: b - a, memory=lambda a, b, k: 10, limit=3) is None


def test_best_split_refuses_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages"):
        best_split(3, 4, lambda a, b, k: 1.0)


# -- profiles ------------------------------------------------------------------------------------------


def test_a_profile_round_trips_through_the_profilers_json(tmp_path: Path) -> None:
    profile = uniform_profile(3)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_dict(profile)))
    loaded = load_profile(path)
    assert loaded.layers == profile.layers and loaded.micro_batch == 4 and loaded.input_bytes == 10.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("micro_batch"), r"missing key\(s\) \['micro_batch'\]"),
        (lambda d: d["layers"][1].pop("saved_bytes"), r"layer 1 lacks \['saved_bytes'\]"),
        (lambda d: d["layers"][0].update(forward_s=-1), "layer 0: layer 'l0': forward_s must be a finite number >= 0"),
        (lambda d: d.update(format="other/9"), "format 'other/9' is not 'fdg_schedule.profile/1'"),
        (lambda d: d.update(layers=[]), "'layers' must be a non-empty list"),
    ],
)
def test_a_bad_profile_names_the_field(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    data = profile_to_dict(uniform_profile(3))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_profile(path)


def test_a_trace_becomes_one_layer_per_stage() -> None:
    def span(pid: int, cat: str, dur_us: float) -> dict:
        return {"ph": "X", "pid": pid, "cat": cat, "dur": dur_us, "ts": 0, "name": cat[0]}

    trace = {
        "otherData": {"schedule": ["fdg"], "ranks": {"0": {"stage_id": 0}, "1": {"stage_id": 1}}},
        "traceEvents": [span(0, "forward", 100), span(0, "forward", 300), span(0, "backward", 400),
                        span(1, "forward", 150), span(1, "backward", 250), span(1, "step", 10)],
    }  # fmt: skip
    profile = profile_from_trace(trace, activation_bytes=[64.0])
    assert [layer.forward_s for layer in profile.layers] == pytest.approx([200e-6, 150e-6])
    assert profile.layers[1].step_s == pytest.approx(10e-6) and profile.layers[0].activation_bytes == 64.0
    with pytest.raises(ValueError, match="merge the per-rank parts"):
        profile_from_trace({"traceEvents": []})


# -- estimates -----------------------------------------------------------------------------------------


def test_resnet50_estimate_counts_the_known_flops_and_parameters() -> None:
    # ResNet-50 at 224 px: 4.1 GMACs (8.2 GFLOPs) forward per image, 25.6 M parameters.
    profile = estimate_resnet("resnet50", 2, GPUS["A100"], "float32")
    params = sum(layer.param_bytes for layer in profile.layers) / 4
    assert params == pytest.approx(25.56e6, rel=0.01)
    assert len(profile.layers) == 1 + 16 + 2  # stem, blocks, pool, classifier (fdg_schedule.zoo.resnet)
    # time = FLOPs / (peak x efficiency) + bytes / bandwidth; bound it below by the FLOP part alone
    forward_flop_s = 2 * 8.2e9 / (GPUS["A100"].peak("float32") * 0.5)
    assert forward_flop_s < sum(layer.forward_s for layer in profile.layers) < 3 * forward_flop_s


def test_transformer_estimate_has_the_named_size() -> None:
    gpt = estimate_transformer(TRANSFORMERS["gpt-1.3b"], 1, GPUS["H100"])
    assert sum(layer.param_bytes for layer in gpt.layers) / 2 == pytest.approx(1.42e9, rel=0.02)  # incl. untied head
    llama = estimate_transformer(TRANSFORMERS["llama-8b"], 1, GPUS["H100"])
    assert sum(layer.param_bytes for layer in llama.layers) / 2 == pytest.approx(8.03e9, rel=0.02)
    assert len(llama.layers) == 2 + 2 * 32


# -- predictions ---------------------------------------------------------------------------------------


def test_fdg_at_k2_on_a_balanced_model_is_twice_backprop_without_communication() -> None:
    profile = uniform_profile(8, step=0.0, act=0.0)
    cluster = Cluster(gpus_per_node=8, intra_latency=0.0)
    p = predict(profile, Variant("fdg"), 2, cluster)
    assert p.bounds == [0, 4, 8]
    assert p.time_per_micro_batch_s == pytest.approx(12.0)  # 4 layers x (1 + 2)
    assert p.samples_per_s == pytest.approx(4 / 12.0)
    one_f_one_b = predict(profile, Variant("1f1b"), 2, cluster, micro_batches=4)
    assert one_f_one_b.step_s == pytest.approx((4 + 1) * 12.0)  # (m + K - 1) slots


def test_interleaved_cuts_between_nodes_move_to_small_activations() -> None:
    # 16 layers whose outputs are large except those of layers 2, 6, 10 and 14. K = 4 ranks on two
    # nodes of 2, v = 2: chunk c runs on rank c % 4, so the cuts after chunks 1, 3 (the wrap from rank
    # 3 to rank 0) and 5 cross between nodes; a cut there must carry a small activation.
    small = {2, 6, 10, 14}
    base = uniform_profile(16, act=1.0)
    layers = tuple(dataclasses.replace(layer, activation_bytes=1.0 if i in small else 1000.0)
                   for i, layer in enumerate(base.layers))  # fmt: skip
    profile = dataclasses.replace(base, layers=layers)
    cluster = Cluster(gpus_per_node=2, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=100.0, inter_latency=0.0)
    p = predict(profile, Variant("interleaved"), 4, cluster, micro_batches=8)
    crossing = [p.bounds[c + 1] - 1 for c in (1, 3, 5)]  # the last layer before each such cut
    assert set(crossing) <= small, p.bounds
    assert p.inter_node_bytes_per_micro_batch == pytest.approx(2 * 3 * 1.0)  # 3 cuts, activation and gradient


def test_memory_in_a_prediction_is_static_plus_held() -> None:
    profile = uniform_profile(8, params=40.0, saved=100.0)
    model = CostModel(bytes_per_param=16.0)
    p = predict(profile, Variant("fdg"), 4, Cluster(), model=model)
    static = 2 * 40 / 4 * 16  # 2 layers x 10 parameters x 16 bytes
    # per micro-batch in flight: 2 layers x 100 saved bytes and the stage's input of 10 bytes
    assert p.memory_bytes == pytest.approx([static + d * 210 for d in (6, 4, 2)] + [static + 210])
    assert p.fits


def test_no_split_fits_a_tiny_memory_limit_and_the_plan_says_so() -> None:
    profile = uniform_profile(8)
    p = predict(profile, Variant("fdg"), 2, Cluster(), memory_limit=10.0)
    assert not p.fits
    result = plan(profile, Cluster(memory=10.0), [2, 4, 16], [Variant("fdg"), Variant("1f1b")])
    assert result.recommendation is None
    assert ("fdg current/stored", 16, "fdg current/stored at K=16 needs 16 chunks but the model has 8 layers") in (
        result.skipped
    )


def test_recommend_picks_the_fastest_that_fits() -> None:
    # Per layer: 100 bytes held per micro-batch in flight, 10 parameters x 16 bytes; per stage its input,
    # 10 bytes per micro-batch in flight. With 1160 bytes per device 1F1B's balanced K=4 split fits
    # (stage 0: 4 x (2 x 100 + 10) + 2 x 160); FDG's stage 0 holds 6 micro-batches, so FDG must move
    # layers off it (1, 2, 3, 2) and its slowest stage does 3 layers. At K=2 neither fits.
    profile = uniform_profile(8, saved=100.0)
    cluster = Cluster(gpus_per_node=8, memory=1160.0)
    result = plan(profile, cluster, [2, 4], [Variant("fdg"), Variant("1f1b")], micro_batches=lambda k: 4 * k)
    by = {(p.variant.name, p.stages): p for p in result.predictions}
    assert not by[("fdg current/stored", 2)].fits and not by[("deepspeed 1f1b", 2)].fits
    assert by[("fdg current/stored", 4)].fits and by[("fdg current/stored", 4)].bounds == [0, 1, 3, 6, 8]
    assert by[("deepspeed 1f1b", 4)].fits and by[("deepspeed 1f1b", 4)].bounds == [0, 2, 4, 6, 8]
    chosen = result.recommendation
    assert chosen is not None and (chosen.variant.name, chosen.stages) == ("deepspeed 1f1b", 4)
    # with room for both, FDG's balanced split wins at K = 4
    roomy = plan(profile, Cluster(memory=1e9), [4], [Variant("fdg"), Variant("1f1b")], micro_batches=lambda k: 4 * k)
    assert roomy.recommendation is not None and roomy.recommendation.variant.name == "fdg current/stored"


def test_k_beyond_the_layers_is_infeasible_not_an_error() -> None:
    with pytest.raises(Infeasible, match="needs 16 chunks but the model has 8 layers"):
        predict(uniform_profile(8), Variant("interleaved", chunks=2), 8, Cluster())


def test_named_clusters_are_valid() -> None:
    assert {"a100-100gbe", "h100-ib", "cpu-gloo", "pcie3"} <= set(CLUSTERS)
    assert math.isclose(CLUSTERS["a100-100gbe"].gpus_per_node, 8)
