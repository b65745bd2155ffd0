"""The procedural family's baseline scripts (sandbox/seed_corpus/procedural.py) and what of them
enters the SFT corpus: the training instances only, never a held-out or held-out-family one."""
import ast
import json

import pytest

from sandbox import seed_corpus
from sandbox.seed_corpus import procedural as proc_scripts
from sandbox.tasks import procedural, registry
from sandbox.tasks.procedural_schema import make_spec, parse_task_id

TRAIN = set(procedural.split_ids("train"))
HELD = set(procedural.split_ids("heldout")) | set(procedural.split_ids("heldout_family"))


def _procedural(ids):
    return {t for t in ids if procedural.is_procedural(t)}


def test_baseline_scripts_compile_and_find_the_columns_in_the_data():
    """No script names an instance's id, target or (but a held-out-family token column)
    feature: one model's script is the same text on every training-kind instance of a metric."""
    by_metric_model: dict = {}
    for t in procedural.all_ids()[::7]:
        spec = make_spec(*parse_task_id(t))
        scripts = proc_scripts.baseline_scripts(t)
        assert [s.name for s in scripts] == sorted(s.name for s in scripts) and len(scripts) == 8
        for s in scripts:
            ast.parse(s.code)
            assert s.task_id == t
            for needle in ('pd.read_csv("./input/train.csv")', 'print(f"VALIDATION_METRIC:',
                           '"./submission/submission.csv"', "train_test_split(",
                           "ID = test.columns[0]"):
                assert needle in s.code, (t, s.name, needle)
            named = [c for c in (spec.id_column, spec.target, *spec.feature_names)
                     if json.dumps(c) in s.code]
            assert named == ([spec.text_column] if spec.text_column else []), (t, s.name)
            assert "sandbox" not in s.code and "sklearn.datasets" not in s.code
            if not spec.text_column:
                by_metric_model.setdefault((spec.metric, s.name), set()).add(s.code)
        assert len({s.code for s in scripts}) == 8
        names = {s.name for s in scripts}
        assert all(w in names and s in names for w, s in proc_scripts.declared_pairs(t))
    assert all(len(codes) == 1 for codes in by_metric_model.values())


def test_the_roles_a_script_reads_from_the_data_are_the_instance_s(tmp_path):
    """The id, target, numeric and categorical columns the scripts' lines find in an
    instance's prepared train.csv / test.csv are those its generator made, in its order."""
    import pandas as pd

    for t in procedural.all_ids()[::5]:
        spec = make_spec(*parse_task_id(t))
        procedural.prepare_instance(spec, tmp_path / t, 0)
        train = pd.read_csv(tmp_path / t / "public" / "train.csv")
        test = pd.read_csv(tmp_path / t / "public" / "test.csv")
        env = {"train": train, "test": test}
        code = proc_scripts.baseline_scripts(t)[0].code
        lines = [x for x in code.splitlines()
                 if x.startswith(("ID =", "TARGET =", "X, y =", "X_test =", "TEXT =", "NUM =",
                                  "CAT ="))]
        exec("\n".join(lines), env)
        assert (env["ID"], env["TARGET"]) == (spec.id_column, spec.target), t
        assert env["NUM"] == spec.names_of("num", "int"), t
        assert env["CAT"] == spec.names_of("cat"), t


def test_baseline_scripts_refuse_a_non_procedural_id():
    with pytest.raises(KeyError, match="not a registered procedural instance"):
        proc_scripts.baseline_scripts("iris-species")


def test_sft_corpus_holds_training_instances_only():
    """Everything the SFT corpus is built from (sandbox.seed_corpus: the task ids with seed
    scripts, their scripts, the improve pairs measured or declared, the scored references)
    names procedural training instances only."""
    assert _procedural(seed_corpus.sft_task_ids()) == TRAIN
    assert seed_corpus.procedural_task_ids() == sorted(TRAIN)
    assert not _procedural(seed_corpus.task_ids())         # offline files only
    for t in sorted(TRAIN)[::10]:
        assert {s.task_id for s in seed_corpus.list_scripts(t)} == {t}
    for t in sorted(HELD):
        with pytest.raises(KeyError, match="held out"):
            seed_corpus.list_scripts(t)
    for measured_only in (True, False):
        pairs = seed_corpus.improvement_pairs(seed=0, measured_only=measured_only)
        ids = _procedural(w.task_id for w, _ in pairs) | _procedural(s.task_id for _, s in pairs)
        assert ids and ids <= TRAIN and not ids & HELD
        assert all(w.task_id == s.task_id for w, s in pairs)
    rows = seed_corpus.procedural_pair_rows(seed=0)
    assert rows and {r["task_id"] for r in rows} == TRAIN
    measured = [(w.task_id, w.name, s.name) for w, s in seed_corpus.improvement_pairs(seed=0)
                if procedural.is_procedural(w.task_id)]
    assert measured == [(r["task_id"], r["weak"], r["strong"]) for r in rows if r["improves"]]
    assert len(measured) >= 2 * len(TRAIN)   # most declared pairs really improve


def test_reference_scores_cover_every_instance_from_the_compact_sweep():
    for t in (sorted(TRAIN)[0], sorted(HELD)[0]):
        scores = seed_corpus.reference_scores(t, seed=0)
        assert set(scores) <= {s.name for s in proc_scripts.baseline_scripts(t)}
        assert len(scores) >= 6
    assert seed_corpus.reference_scores("iris-species", seed=0)   # offline: results.json
    assert seed_corpus.reference_scores(sorted(TRAIN)[0], seed=9) == {}


def test_sft_examples_from_training_instances_and_refused_for_held_out(tmp_path):
    """``ace_jax.train.sft.build_sft_examples`` (the warm start's corpus) on procedural tasks:
    drafts, improve and debug examples of training instances; a held-out instance is refused."""
    from ace_jax.train import sft

    train_ids = sorted(TRAIN)[:2]
    tasks = [registry.load_task(t, tmp_path, seed=0) for t in train_ids]
    cfg = sft.default_config()
    cfg.kinds = ("draft", "improve", "debug")
    examples = sft.build_sft_examples(tasks, cfg)
    assert {e.task_id for e in examples} == set(train_ids)
    assert {e.kind for e in examples} == {"draft", "improve", "debug"}
    for t in train_ids:
        drafts = [e for e in examples if e.task_id == t and e.kind == "draft"]
        assert len(drafts) == 8
        spec = make_spec(*parse_task_id(t))
        assert spec.target in drafts[0].prompt
    held = registry.load_task(sorted(HELD)[0], tmp_path, seed=0)
    with pytest.raises(KeyError, match="held out"):
        sft.build_sft_examples([held], cfg)
