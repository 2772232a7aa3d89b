"""Per-test times of two pytest junit XML files: the tests that passed in both, summed and per file."""

import collections
import sys
import xml.etree.ElementTree as ET


def read(path):
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = any(child.tag in ("failure", "error", "skipped") for child in case)
        out[(case.get("classname"), case.get("name"))] = (float(case.get("time", 0)), bad)
    return out


old, new = read(sys.argv[1]), read(sys.argv[2])
common = [k for k in old if k in new and not old[k][1] and not new[k][1]]
so, sn = sum(old[k][0] for k in common), sum(new[k][0] for k in common)
total_old, total_new = sum(v[0] for v in old.values()), sum(v[0] for v in new.values())
print(f"old: {len(old)} tests {total_old:.0f} s; new: {len(new)} tests {total_new:.0f} s")
print(f"passed in both: {len(common)} tests, old {so:.0f} s, new {sn:.0f} s, new/old {sn / so:.3f}")
only_new = [k for k in new if k not in old]
print(f"new only: {len(only_new)} tests, {sum(new[k][0] for k in only_new):.0f} s")
by_file = collections.defaultdict(lambda: [0.0, 0.0])
for k in common:
    f = k[0] or "?"
    by_file[f][0] += old[k][0]
    by_file[f][1] += new[k][0]
rows = sorted(by_file.items(), key=lambda kv: -(kv[1][1] - kv[1][0]))
print("largest changes (file: old -> new s):")
for f, (o, n) in rows[:8] + rows[-5:]:
    print(f"  {f}: {o:.0f} -> {n:.0f} ({n - o:+.0f})")
