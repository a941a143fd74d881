"""Merge train_gpt.py result folders (several device runs of one setting) into one table, CSVs
and plots: python3 scripts/torch-eval-report.py OUT_DIR RESULT_DIR... (a later folder's mode
replaces an earlier one's; modes that failed in a later run keep the earlier result)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_gpt  # noqa: E402

out, dirs = sys.argv[1], sys.argv[2:]
by_mode = {}
for d in dirs:
    for f in sorted(os.listdir(d)):
        if f.endswith(".json") and not f.endswith(".trace.json"):
            r = json.load(open(os.path.join(d, f)))
            if "mode" in r and (r.get("outcome") == "ok" or r["mode"] not in by_mode):
                by_mode[r["mode"]] = r
order = [m for m in train_gpt.MODES if m in by_mode]
os.makedirs(out, exist_ok=True)
train_gpt.summarize([by_mode[m] for m in order], out)
