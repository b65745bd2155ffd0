"""The task pages of the procedural instances (sandbox/tasks/procedural_description.py)."""
from sandbox.tasks import procedural
from sandbox.tasks.procedural_description import describe
from sandbox.tasks.procedural_schema import make_spec, parse_task_id

SPECS = [make_spec(*parse_task_id(t)) for t in procedural.all_ids()[:60]]


def test_descriptions_differ_in_wording():
    descs = [describe(s, 100, 50, (s.target,)) for s in SPECS]
    assert len({d.split("\n", 1)[0] for d in descs}) > 30          # titles differ
    assert len({d.split("\n")[2][:12] for d in descs}) >= 3         # opening sentences differ
    assert len(set(descs)) == len(descs)
