"""The candidates screen's plan, arms and pairing (benchmarks/convergence/candidates_screen.py); no training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.convergence import candidates_screen as screen
from fdg_schedule import FDGConfig


def test_the_plan_runs_each_run_once_bp_first_and_the_split_at_k4_only() -> None:
    runs = screen.plan()
    assert len({(r.task, r.name, r.seed) for r in runs}) == len(runs)
    first = runs[: 2 + len(screen.PLAN["muon"]) + len(screen.PLAN["adamw"]) + 2]
    assert [r.name for r in first[:3]] == ["adamw_bp", "muon_bp", "muon_k4_none"]
    assert {r.task for r in first} == {"llama"} and {r.seed for r in first} == {200}
    assert all(r.stages == 4 for r in runs if r.arm.endswith("_split"))
    arms = ("bp", "bp_a2", *screen.ARMS, *(a + "_split" for a in screen.ARMS), *(a + "_a2" for a in screen.ARMS))
    assert all(r.stages in (1, 4, 8) and r.arm in arms for r in runs)


def test_the_first_pass_ran_every_arm_and_the_narrowed_plan_keeps_its_runs() -> None:
    """The runs already written under the first plan keep their names, so a restarted queue skips them."""
    cell = {(r.optimizer, r.arm) for r in screen.plan() if (r.seed, r.task, r.stages) == (200, "llama", 4)}
    assert {(opt, arm) for opt, arm in cell if opt == "lion"} == {("lion", arm) for arm in screen.LION_ARMS}
    for optimizer in screen.PLAN:
        assert {(optimizer, a) for a in screen.PLAN[optimizer] + screen.SPLIT_ARMS[optimizer]} <= cell
        assert {(optimizer, a) for a in screen.SEED_200[4][optimizer]} <= cell
    for seed, cells in ((200, screen.SEED_200), (201, screen.LEADING), (202, screen.LEADING)):
        for task in screen.TASKS:
            for k in (4, 8):
                if (seed, task, k) == (200, "llama", 4):
                    continue
                got = {(r.optimizer, r.arm) for r in screen.plan()
                       if (r.seed, r.task, r.stages, r.accumulate) == (seed, task, k, 1)}  # fmt: skip
                assert got == {(o, a) for o, arms in cells[k].items() for a in arms}
        bps = [r for r in screen.plan() if r.seed == seed and r.stages == 1 and r.accumulate == 1]
        assert len(bps) == 4 + (seed == 200)  # BP-AdamW and BP-Muon on both tasks, BP-Lion on seed 200's LLaMA
    lion = [i for i, r in enumerate(screen.plan()) if r.optimizer == "lion"]
    assert [screen.plan()[i].name for i in lion] == ["lion_bp", *(f"lion_k4_{arm}" for arm in screen.LION_ARMS)]
    k8 = [i for i, r in enumerate(screen.plan()) if (r.seed, r.task, r.stages, r.accumulate) == (200, "llama", 8, 1)]
    assert lion == list(range(max(k8) + 1, max(k8) + 5))  # after seed 200's LLaMA K = 8, before GPT-2
    accumulated = [r for r in screen.plan() if r.accumulate == 2]
    assert [r.name for r in accumulated] == ["adamw_bp_a2", "muon_bp_a2", "muon_k4_first_p1_a2", "adamw_k4_v1_a2",
                                             "muon_k8_first_p1_a2", "adamw_k8_v1_a2"]  # fmt: skip
    assert all(r.baseline.name == f"{r.optimizer}_bp_a2" for r in accumulated)
    assert screen.plan().index(accumulated[0]) == max(lion) + 1
    assert len(screen.plan()) == 89


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "lion"])
def test_every_arm_is_a_valid_fdg_block(optimizer: str) -> None:
    for arm in {r.arm for r in screen.plan() if r.optimizer == optimizer and r.stages > 1}:
        keys = screen.fdg_keys(arm, optimizer, 1000)
        config = FDGConfig(**keys)
        assert config.weights == "stashed" and config.grad_shrink == 1.0
    look = FDGConfig(**screen.fdg_keys("look", optimizer, 1000))
    assert look.predict_momentum == screen.MOMENTUM[optimizer] and look.predict_decay == 0.0
    acc = FDGConfig(**screen.fdg_keys("v1_a2", optimizer, 1000))
    assert (acc.accumulate, acc.delay_lr_ticks) == (2, 2000) and FDGConfig(
        **screen.fdg_keys("v1", optimizer, 10)
    ).accumulate == 1
    v1 = FDGConfig(**screen.fdg_keys("v1_p05", optimizer, 1000))
    assert (v1.delay_lr_ticks, v1.predict_horizon, v1.delay_momentum_raise, v1.predict_scale) == (
        2000, "first_stage", 1.0, 0.5)  # fmt: skip


def test_v1_is_what_the_rule_chooses_for_adamw_with_the_runs_cosine_schedule() -> None:
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from fdg_schedule.corrections import auto_corrections

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, betas=(0.9, 0.95))
    scheduler = WarmupCosineLR(opt, total_num_steps=1000, warmup_num_steps=100)
    chosen, _ = auto_corrections.resolve(FDGConfig(corrections="auto", weights="stashed"), opt, scheduler, 4)
    ours = FDGConfig(**screen.fdg_keys("v1", "adamw", 1000))
    for key in auto_corrections.RULE_KEYS:
        assert getattr(chosen, key) == getattr(ours, key), key


def _write(out: Path, run: screen.Run, test: float, cpu: str = "x") -> None:
    path = run.path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"test": test, "machine": {"cpu": cpu}}))


def test_an_arm_pairs_with_bp_of_its_optimizer_seed_and_machine(tmp_path: Path) -> None:
    for seed, (bp, arm) in zip((200, 201, 202), ((4.0, 4.04), (4.0, 4.08), (5.0, 5.0))):
        _write(tmp_path, screen.Run("llama", "muon", 1, "bp", seed), bp)
        _write(tmp_path, screen.Run("llama", "muon", 4, "first_p1", seed), arm, cpu="x" if seed < 202 else "other")
    _write(tmp_path, screen.Run("llama", "adamw", 1, "bp", 200), 1.0)  # another optimizer's BP: not a pair
    (row,) = screen.rows(tmp_path)
    assert (row["optimizer"], row["K"], row["arm"], row["n"]) == ("muon", 4, "first_p1", 2)  # seed 202: other machine
    assert row["diffs"] == pytest.approx([1.0, 2.0]) and row["mean"] == pytest.approx(1.5)
    assert "| llama | muon | 4 | `first_p1` | 2 | +1.50 % (0.71), +4.66 % |" in screen.report(tmp_path)
    _write(tmp_path, screen.Run("llama", "adamw", 4, "v1", 200), 1.1)
    assert "| llama | adamw | 4 | `v1` | 1 | +10.00 % (one seed: no spread, no bound) |" in screen.report(tmp_path)


def test_the_queue_writes_each_run_when_it_ends_and_continues_where_it_stopped(tmp_path: Path, monkeypatch) -> None:
    done: list[str] = []

    def fake_run(run: screen.Run, max_ticks: int | None, smoke: bool) -> dict:
        if len(done) == 3:
            raise KeyboardInterrupt  # the queue stops in its fourth run
        done.append(run.name)
        return {"test": 4.0}

    monkeypatch.setattr(screen, "run_one", fake_run)
    monkeypatch.setattr(screen.provenance, "machine", lambda: {"cpu": "x"})
    monkeypatch.setattr(screen, "plan", lambda: PLAN[:5])
    with pytest.raises(KeyboardInterrupt):
        screen.queue(tmp_path)
    assert sorted(p.name for p in (tmp_path / "llama").glob("*.json")) == sorted(f"{n}_s200.json" for n in done)
    done.clear()
    monkeypatch.setattr(screen, "run_one", lambda run, max_ticks, smoke: done.append(run.name) or {"test": 4.0})
    screen.queue(tmp_path)
    assert done == [r.name for r in PLAN[3:5]]  # only what was not written yet


PLAN = screen.plan()
