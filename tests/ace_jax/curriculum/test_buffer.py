"""EvolvingBuffer: seeding, children, de-duplication, statistics, pruning, export/apply."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ace_jax.curriculum import buffer as B, state_stats
from sandbox.result import ExecutionResult, Status
from sandbox.tasks.targets import TaskTargets

TARGETS = [TaskTargets("hi", gold=0.9, median=0.7, baseline=0.5),
           TaskTargets("lo", gold=1.0, median=2.0, baseline=4.0, lower_is_better=True)]


def make(capacity=64, **kw):
    cfg = B.default_config()
    cfg.capacity = capacity
    for k, v in kw.items():
        cfg[k] = v
    return B.EvolvingBuffer(cfg, TARGETS)


def ok(score, stderr=""):
    return ExecutionResult(Status.OK, exit_code=0, valid_submission=True, dev_score=score, stderr=stderr)


def fail(status=Status.RUNTIME_ERROR, stderr="Traceback: boom"):
    return ExecutionResult(status, exit_code=1, stderr=stderr)


def test_seed_creates_drafts_and_reference_states():
    buf = make()
    ids = buf.seed([B.SeedSolution("hi", "fit()", 0.8), B.SeedSolution("lo", "fit2()", 1.5)])
    assert len(ids) == 4 == len(buf)
    drafts = [buf.get(i) for i in ids[:2]]
    assert [d.task_id for d in drafts] == ["hi", "lo"] and all(d.code == "" and d.score is None for d in drafts)
    ref = buf.get(ids[2])
    assert (ref.origin, ref.depth, ref.parent_id, ref.score) == ("seed", 0, None, 0.8)
    slots = buf.slots_for_ids(ids)
    np.testing.assert_allclose(buf.stats.headroom[slots], [1.0, 1.0, 0.5, 0.5])
    np.testing.assert_array_equal(buf.stats.task[slots], [0, 1, 0, 1])
    assert (buf.stats.status[slots] == state_stats.NO_STATUS).all()
    assert buf.stats.valid.sum() == 4
    with pytest.raises(B.UnknownTaskError):
        buf.add_root("nope", "", None)
    with pytest.raises(ValueError, match="origin"):
        buf.add_root("hi", "", None, origin="weird")


def test_add_children_records_every_execution_and_parent_stats():
    buf = make(history_len=2, stderr_tail_chars=5)
    root = buf.add_root("hi", "base()", 0.6)
    kids = [B.Child("a()", ok(0.8), 1.2), B.Child("b()", fail(stderr="0123456789"), 0.0),
            B.Child("c()", fail(Status.TIMEOUT), 0.0), B.Child("d()", ok(0.55), 0.9)]
    ids = buf.add_children(root, kids, step=3)
    assert len(set(ids)) == 4 and len(buf) == 5
    a, b, c, d = (buf.get(i) for i in ids)
    assert (a.parent_id, a.depth, a.origin, a.created_step) == (root, 1, "rollout", 3)
    assert a.score == 0.8 and b.score == 0.6 and d.score == 0.6  # best along the lineage
    assert b.history[-1].status == "runtime_error" and b.history[-1].stderr_tail == "56789"
    assert c.status == "timeout" and a.history[-1].score == 0.8 and b.history[-1].score is None
    p = buf.slot_of[root]
    s = buf.stats
    rewards = np.array([1.2, 0.0, 0.0, 0.9])
    assert s.reward_mean[p] == pytest.approx(rewards.mean())
    assert s.reward_var[p] == pytest.approx(rewards.var())
    assert s.visits[p] == 1 and s.best_child_score[p] == pytest.approx(0.8) and s.last_active[p] == 3
    assert s.status[buf.slot_of[ids[1]]] == state_stats.STATUS_CODES.index("runtime_error")
    # history is bounded: a grandchild keeps only the last history_len summaries
    g = buf.add_children(ids[0], [B.Child("e()", fail(), 0.0)], step=4)[0]
    g2 = buf.add_children(g, [B.Child("f()", ok(0.85), 1.0)], step=5)[0]
    assert [h.status for h in buf.get(g2).history] == ["runtime_error", "ok"]
    # a new group replaces the latest-group statistics
    buf.add_children(root, [B.Child("z()", ok(0.7), 1.0), B.Child("y()", ok(0.7), 1.0)], step=6)
    assert s.reward_var[p] == 0.0 and s.visits[p] == 2 and s.best_child_score[p] == pytest.approx(0.8)


def test_duplicate_code_under_same_parent_is_merged():
    buf = make()
    root = buf.add_root("lo", "", None)
    ids = buf.add_children(root, [B.Child("x = 1\n", ok(1.8), 1.0), B.Child("x = 1   \n\n", ok(1.4), 1.0),
                                  B.Child("y = 2", fail(), 0.0)], step=1)
    assert ids[0] == ids[1] != ids[2] and len(buf) == 3
    assert buf.get(ids[0]).score == 1.4  # lower is better: the better of the two
    assert buf.stats.headroom[buf.slot_of[ids[0]]] == pytest.approx(0.4)
    assert buf.stats.reward_var[buf.slot_of[root]] == pytest.approx(np.var([1.0, 1.0, 0.0]))
    again = buf.add_children(root, [B.Child("x = 1", fail(), 0.0)], step=2)
    assert again == [ids[0]] and len(buf) == 3
    # same code under a different parent is a different state
    other = buf.add_children(ids[2], [B.Child("x = 1", ok(1.9), 1.0)], step=3)
    assert other[0] not in ids and len(buf) == 4


def test_errors_are_typed():
    buf = make()
    root = buf.add_root("hi", "", None)
    with pytest.raises(B.UnknownStateError):
        buf.add_children(12345, [B.Child("a", ok(0.1), 1.0)], step=0)
    with pytest.raises(ValueError, match="at least one"):
        buf.add_children(root, [], step=0)
    with pytest.raises(ValueError, match="finite"):
        buf.add_children(root, [B.Child("a", ok(0.1), float("nan"))], step=0)
    with pytest.raises(B.UnknownStateError):
        buf.mark_sampled([999], 1)
    with pytest.raises(B.UnknownStateError):
        buf.ids_for_slots([5])
    with pytest.raises(ValueError, match="duplicate"):
        B.EvolvingBuffer(B.default_config(), TARGETS + TARGETS[:1])


def test_mark_sampled_and_slot_mapping():
    buf = make()
    ids = buf.seed()
    buf.mark_sampled([ids[1]], 7)
    slot = buf.slot_of[ids[1]]
    assert buf.stats.last_sampled[slot] == 7 and buf.stats.last_active[slot] == 7
    assert buf.stats.last_sampled[buf.slot_of[ids[0]]] == state_stats.NEVER
    assert buf.ids_for_slots(np.array([slot])) == [ids[1]]


def test_pruning_policy_keeps_protected_and_one_per_task_status():
    buf = make(capacity=12, prune_to=0.5, stale_after_steps=5, protect_recent_steps=0)
    root_hi, root_lo = buf.seed()
    ok_ids = buf.add_children(root_hi, [B.Child(f"ok{i}", ok(0.6 + 0.01 * i), 1.0) for i in range(4)], step=0)
    to_ids = buf.add_children(root_hi, [B.Child(f"to{i}", fail(Status.TIMEOUT), 0.0) for i in range(3)], step=0)
    buf.add_children(root_lo, [B.Child(f"l{i}", fail(Status.OOM), 0.0) for i in range(3)], step=10)
    assert len(buf) == 12
    buf.mark_sampled([ok_ids[0], to_ids[0]], 20)   # selected in the current step
    removed = buf.prune(step=20, target_size=6)
    assert len(buf) == 6 and len(removed) == 6
    assert ok_ids[0] in buf and to_ids[0] in buf  # protected
    # at least one state per (task, status kind) survives: seeds ("none"), ok, timeout, oom
    kinds = {(buf.get(i).task_id, buf.get(i).status) for i in buf.states}
    assert kinds >= {("hi", None), ("lo", None), ("hi", "ok"), ("hi", "timeout"), ("lo", "oom")}
    # the order of removal: test_pruning_drops_stale_before_fresh_and_low_potential_first
    assert (buf.stats.valid.sum() == len(buf)) and set(buf.slot_of) == set(buf.states)


def test_pruning_drops_stale_before_fresh_and_low_potential_first():
    buf = make(capacity=20, stale_after_steps=5, protect_recent_steps=0, keep_per_task_status=False)
    r = buf.add_root("hi", "", None, step=0)
    old = buf.add_children(r, [B.Child(f"old{i}", ok(0.6), 1.0) for i in range(3)], step=0)
    new = buf.add_children(r, [B.Child(f"new{i}", ok(0.6), 1.0) for i in range(3)], step=9)
    # new[0]: a mixed group (potential 0.5); new[1]: a zero-variance group (potential 0);
    # new[2] and the grandchildren: unvisited (potential 1); the root's latest group has var 0.
    buf.add_children(new[0], [B.Child("q", ok(0.6), 1.0), B.Child("w", fail(), 0.0)], step=9)
    buf.add_children(new[1], [B.Child("e", ok(0.6), 1.0), B.Child("t", ok(0.6), 1.0)], step=9)
    assert len(buf) == 11
    removed = buf.prune(step=10, target_size=6)
    assert set(removed[:3]) == set(old)  # stale first
    assert set(removed[3:]) == {r, new[1]}                              # then zero potential
    assert new[0] in buf and new[2] in buf


def test_pruning_on_insert_and_buffer_full():
    buf = make(capacity=4, protect_recent_steps=5)
    r = buf.add_root("hi", "", None)
    ids = buf.add_children(r, [B.Child("a", ok(0.6), 1.0), B.Child("b", ok(0.61), 1.0)], step=0)
    buf.mark_sampled([r, *ids], step=1)
    buf.add_root("lo", "", None, step=1)
    with pytest.raises(B.BufferFullError):
        buf.add_children(ids[0], [B.Child("c", ok(0.6), 1.0)], step=2)  # everything protected
    buf2 = make(capacity=4, protect_recent_steps=0, prune_to=0.5)
    r = buf2.add_root("hi", "", None)
    kids = buf2.add_children(r, [B.Child(c, ok(0.6), 0.0) for c in "abc"], step=0)
    more = buf2.add_children(kids[0], [B.Child("d", ok(0.6), 1.0)], step=30)  # prunes to make room
    assert len(buf2) <= 4 and more[0] in buf2 and kids[0] in buf2  # the parent is protected


def test_export_apply_roundtrip_equality():
    buf = make(capacity=16)
    ids = buf.seed([B.SeedSolution("hi", "ref()", 0.75)])
    kids = buf.add_children(ids[2], [B.Child("a", ok(0.8), 1.0), B.Child("b", fail(), 0.0)], step=1)
    buf.mark_sampled(kids, 2)
    full = buf.export_full()
    other = make(capacity=16)
    other.apply(full)
    assert other.states == buf.states and other.next_id == buf.next_id and other.slot_of == buf.slot_of
    for name, arr in buf.stats.arrays().items():
        np.testing.assert_array_equal(arr, other.stats.arrays()[name], err_msg=name)
    # deltas: prune + add, then apply only the delta on the copy
    buf.prune(step=100, target_size=4)
    buf.add_children(ids[0], [B.Child("new", ok(0.7), 0.5)], step=100)
    other.apply(buf.export_delta())
    assert other.states == buf.states and other.slot_of == buf.slot_of
    for name, arr in buf.stats.arrays().items():
        np.testing.assert_array_equal(arr, other.stats.arrays()[name], err_msg=name)
    # merging still works on the restored copy (dedupe index rebuilt)
    assert other.add_children(ids[0], [B.Child("new", ok(0.7), 0.5)], step=101) == \
        buf.add_children(ids[0], [B.Child("new", ok(0.7), 0.5)], step=101)
    with pytest.raises(ValueError, match="capacity"):
        make(capacity=8).apply(buf.export_full())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(list(Status)), st.integers(0, 3)),
                min_size=1, max_size=40))
def test_pruning_invariants_under_random_growth(ops):
    """Random growth in a tiny buffer: every (task, status) pair ever seen keeps a state, states
    sampled this step survive, and stats agree with the states."""
    buf = make(capacity=10, protect_recent_steps=0, prune_to=0.6)
    buf.seed()
    seen = {(t, None) for t in ("hi", "lo")}
    for step, (pick, status, code) in enumerate(ops):
        parent = sorted(buf.states)[pick % len(buf)]
        res = ok(0.6) if status is Status.OK else fail(status)
        try:
            buf.add_children(parent, [B.Child(f"c{code}-{step}", res, float(code))], step=step)
        except B.BufferFullError:
            # possible only when every live state is a (task, status) keeper or just sampled
            assert len({(buf.get(i).task_id, buf.get(i).status) for i in buf.states}) + 1 >= len(buf)
            continue
        seen.add((buf.get(parent).task_id, status.value))
        buf.mark_sampled([parent], step)
        assert parent in buf
        kinds = {(buf.get(i).task_id, buf.get(i).status) for i in buf.states}
        assert seen <= kinds
        assert int(buf.stats.valid.sum()) == len(buf) <= 10
        assert {int(buf.stats.state_id[s]) for s in np.flatnonzero(buf.stats.valid)} == set(buf.states)


def test_state_is_json_serialisable():
    buf = make()
    root = buf.add_root("hi", "base()", 0.6)
    kid = buf.add_children(root, [B.Child("a()", fail(stderr="x" * 1000), 0.0, action="debug")], step=2)[0]
    st_ = buf.get(kid)
    assert B.State.from_json(st_.to_json()) == st_
    assert st_.history[-1].action == "debug" and len(st_.history[-1].stderr_tail) == 400


def test_non_finite_scores_never_enter_the_statistics():
    buf = make()
    root = buf.add_root("hi", "", None)
    kid = buf.add_children(root, [B.Child("a", ok(float("nan")), 0.0), B.Child("b", fail(), 0.0)], step=1)
    assert buf.get(kid[0]).score is None and np.isnan(buf.stats.best_child_score[buf.slot_of[root]])
    assert np.isfinite(buf.stats.headroom[buf.stats.valid]).all()
    assert buf.stats.prior_std[buf.slot_of[kid[0]]] == 0.0 and np.isnan(buf.stats.prior_std[buf.slot_of[root]])
    with pytest.raises(ValueError, match="finite"):
        buf.add_root("hi", "x", float("inf"))


def test_metrics_summarise_the_buffer():
    buf = make(capacity=10)
    root = buf.add_root("hi", "", None)
    buf.add_children(root, [B.Child("a", ok(0.8), 1.0), B.Child("b", fail(), 0.0)], step=1)
    m = buf.metrics()
    assert m["buffer/size"] == 3 and m["buffer/fill"] == pytest.approx(0.3)
    assert m["buffer/visited_frac"] == pytest.approx(1 / 3) and m["buffer/reward_std_visited"] == pytest.approx(0.5)
    assert m["buffer/status/none"] == 1 and m["buffer/status/ok"] == 1 and m["buffer/status/runtime_error"] == 1


def test_extra_rewards_count_in_group_stats_without_states():
    """Invalid-format members of a group (no code, no execution) enter the parent's statistics."""
    from ace_jax.curriculum.buffer import Child, EvolvingBuffer, default_config
    from sandbox.result import ExecutionResult, Status

    buf = EvolvingBuffer(default_config(), [TaskTargets("t", gold=1.0, median=0.5, baseline=0.0)])
    root = buf.add_root("t", "", None)
    ok = ExecutionResult(status=Status.OK, valid_submission=True, dev_score=0.7)
    n_before = len(buf)
    ids = buf.add_children(root, [Child("print(1)\n", ok, 1.0)], step=1, extra_rewards=[-1.0, -1.0])
    assert len(ids) == 1 and len(buf) == n_before + 1
    slot = buf.slots_for_ids([root])[0]
    assert abs(buf.stats.reward_mean[slot] - (-1.0 / 3)) < 1e-6
    assert abs(buf.stats.reward_var[slot] - np.var([1.0, -1.0, -1.0])) < 1e-6
    # A group with no execution at all still updates the parent.
    assert buf.add_children(root, [], step=2, extra_rewards=[-1.0, -1.0]) == []
    assert buf.stats.visits[slot] == 2 and buf.stats.reward_var[slot] == 0.0


def test_child_history_is_the_one_add_children_uses():
    """``child_history`` (shared with the evaluation episodes) builds exactly the stored history."""
    buf = make(history_len=3, stderr_tail_chars=5)
    state = buf.get(buf.add_root("hi", "base()", 0.6))
    for i, res in enumerate([fail(stderr="0123456789"), ok(0.8, stderr="warn"), ok(float("nan")),
                             fail(Status.TIMEOUT, stderr="")]):
        expected = B.child_history(state.history, "debug", res, history_len=3, stderr_tail_chars=5)
        state = buf.get(buf.add_children(state.state_id, [B.Child(f"c{i}", res, 0.0, "debug")],
                                         step=i + 1)[0])
        assert state.history == expected and len(expected) == min(i + 1, 3)
    assert [h.status for h in state.history] == ["ok", "ok", "timeout"]
    assert [h.score for h in state.history] == [0.8, None, None]      # NaN is not a valid score
    first = B.child_history([], "improve", fail(stderr="0123456789"), history_len=3,
                            stderr_tail_chars=5)[-1]
    assert first == B.StepSummary("improve", "runtime_error", None, "56789")
    assert B.step_summary("draft", ok(0.7, stderr="abc"), 0).stderr_tail == ""
    assert B.valid_dev_score(ok(0.7)) == 0.7 and B.valid_dev_score(fail()) is None
    with pytest.raises(ValueError, match="history_len"):
        B.child_history([], "draft", ok(0.7), history_len=0, stderr_tail_chars=5)
