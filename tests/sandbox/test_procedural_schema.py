"""The schemas of the procedural instances (sandbox/tasks/procedural_schema.py): every target
type, metric, theme, id and case style, wording and column type occurs; names are unique."""
import collections

import numpy as np

from sandbox.tasks import procedural
from sandbox.tasks.procedural_schema import THEMES, make_spec, parse_task_id

SPECS = {t: make_spec(*parse_task_id(t)) for t in procedural.all_ids()}


def test_schemas_vary():
    specs = list(SPECS.values())
    assert {s.target_type for s in specs} == {"binary", "multiclass", "regression"}
    assert {s.metric for s in specs} == {"accuracy", "macro_f1", "log_loss", "auc", "rmse", "mae",
                                          "rmsle"}
    assert len({s.id_column for s in specs}) >= 8
    assert len({s.target for s in specs}) >= 40
    assert len({s.theme for s in specs}) == len(THEMES)
    assert {s.id_style for s in specs} == {"hex", "int", "prefixed"}
    assert len({s.case_style for s in specs}) >= 4
    assert {s.wording for s in specs} == {0, 1, 2}
    assert 0.3 < np.mean([s.has_missing for s in specs]) < 0.7
    ftypes = collections.Counter(c.ftype for s in specs for c in s.columns)
    assert set(ftypes) == {"num", "int", "cat", "text"}
    rows = [s.n_rows for s in specs]
    assert min(rows) >= 60 and max(rows) <= 3000 and min(rows) < 100 and max(rows) > 1500
    for s in specs:   # names are unique within an instance
        names = [s.id_column, s.target, *s.feature_names]
        assert len(set(names)) == len(names), s.task_id
        assert (s.text_column is not None) == (s.kind == "tokens")
