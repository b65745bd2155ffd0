"""A small MLE-bench-shaped competition folder with a hand-written config.yaml, for
tests/sandbox/test_mlebench_adapter.py alone: the adapter's mechanics (our fallback metrics, a
grader that crashes or is missing, leaderboard files) on graders MLE-bench does not have. Every
other test uses MLE-bench's own competitions (tests/mlebench_prepared.py), and a script an agent
could write for it."""
import textwrap

import numpy as np
import pandas as pd

CLASSES = ["EAP", "HPL", "MWS"]

AGENT_CODE = """
import csv
overrides = {overrides!r}
rows = list(csv.DictReader(open("input/sample_submission.csv")))
with open("submission/submission.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    for r in rows:
        r.update(overrides.get(r["id"], {{}}))
        w.writerow(r)
print("VALIDATION_METRIC: 1.0")
"""


def write_competition(root, cid, grader_name, grade_fn="mlebench.competitions.x.grade:grade",
                      n=40, leaderboard=(0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.9, 1.0, 1.1)):
    """MLE-bench layout: <root>/<cid>/prepared/{public,private} + config.yaml etc. in <root>/<cid>."""
    rng = np.random.default_rng(0)
    pub = root / cid / "prepared" / "public"
    priv = root / cid / "prepared" / "private"
    pub.mkdir(parents=True)
    priv.mkdir(parents=True)
    ids = [f"id{i:05d}" for i in range(n)]
    y = rng.integers(0, 3, n)
    pd.DataFrame({"id": [f"tr{i}" for i in range(10)], "text": "x", "author": "EAP"}).to_csv(
        pub / "train.csv", index=False)
    pd.DataFrame({"id": ids, "text": "some text"}).to_csv(pub / "test.csv", index=False)
    sample = pd.DataFrame({"id": ids, **{c: 1 / 3 for c in CLASSES}})
    sample.to_csv(pub / "sample_submission.csv", index=False)
    answers = pd.DataFrame({"id": ids, **{c: (y == k).astype(int) for k, c in enumerate(CLASSES)}})
    answers.to_csv(priv / "test.csv", index=False)
    (pub / "description.md").write_text("# public copy\n")
    comp = root / cid
    (comp / "config.yaml").write_text(textwrap.dedent(f"""\
        id: {cid}
        name: Toy
        competition_type: simple
        awards_medals: true
        description: mlebench/competitions/{cid}/description.md
        dataset:
          answers: {cid}/prepared/private/test.csv
          sample_submission: {cid}/prepared/public/sample_submission.csv
        grader:
          name: {grader_name}
          grade_fn: {grade_fn}
        """))
    (comp / "description.md").write_text("# Toy authors\nPredict the author.\n")
    if leaderboard is not None:
        pd.DataFrame({"teamName": [f"t{i}" for i in range(len(leaderboard))],
                      "score": list(leaderboard)}).to_csv(comp / "leaderboard.csv", index=False)
    return answers
