"""cProfile of FDG stored ticks (K = 2, the throughput benchmark's engine variant): where the engine's CPU goes."""

import sys


def work(rank: int, world: int, model: str, parts: list, calls: int) -> str:
    import cProfile
    import io
    import pstats

    from benchmarks.common.throughput_variants import DeepSpeedVariant, variants

    spec = next(s for s in variants(4) if s["name"] == "fdg_current_stored")
    v = DeepSpeedVariant(spec, model, parts)
    for _ in range(4):
        v.unit()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        v.unit()
    prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(70)
    return out.getvalue()


if __name__ == "__main__":
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the ranks import this file by name
    import prof_tick

    from fdg_schedule.tools.launch import run

    model, parts, calls = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    outs = run(prof_tick.work, 2, model, parts, calls, deadline_s=900)
    for r, o in enumerate(outs):
        os.makedirs("out/prof", exist_ok=True)
        with open(f"out/prof/{model}_rank{r}.txt", "w") as file:
            file.write(o)
    print("ok")
