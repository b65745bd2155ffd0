"""StepRollouts: a dynamic-sampling refill appended to a step, and the groups the learner keeps."""
import numpy as np
import pytest

from ace_jax.runtime import generate
from ace_jax.train.rollouts import Rollout, StepRollouts

G, M = 2, 3


def _step(first_state: int, prompts, routes: bool = False) -> StepRollouts:
    n = len(prompts) * G
    rng = np.random.default_rng(first_state)
    gen = generate.GenerationResult(
        rng.integers(0, 50, (n, M)).astype(np.int32), rng.normal(size=(n, M)).astype(np.float32),
        np.full(n, M, np.int32), np.zeros(n, np.int32), np.repeat(np.arange(len(prompts)), G),
        rng.integers(0, 4, (n, M, 1, 2)).astype(np.uint8) if routes else None,
        tuple(np.full((len(p), 1, 2), b, np.uint8) for b, p in enumerate(prompts))
        if routes else None)
    rolls = [Rollout(state_id=first_state + b, task_id="t", text=f"{first_state + b}/{g}",
                     policy_version=0, reward=float(b)) for b in range(len(prompts))
             for g in range(G)]
    return StepRollouts(7, [list(p) for p in prompts], gen, rolls, gen_tokens=n * M,
                        futures=[None] * n)


def test_extend_then_select_groups_keeps_rows_with_their_prompts():
    s = _step(0, [[1, 2], [3]], routes=True)
    more = _step(10, [[4, 5, 6]], routes=True)
    s.extend(more)
    assert s.prompts == [[1, 2], [3], [4, 5, 6]]
    assert s.gen.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert len(s.rollouts) == len(s.futures) == 6 and s.gen_tokens == 18
    assert [r.state_id for r in s.rollouts] == [0, 0, 1, 1, 10, 10]
    kept = s.select_groups([0, 2], G)
    assert kept.prompts == [[1, 2], [4, 5, 6]]
    assert kept.gen.prompt_index.tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(kept.gen.tokens, s.gen.tokens[[0, 1, 4, 5]])
    np.testing.assert_array_equal(kept.gen.routes, s.gen.routes[[0, 1, 4, 5]])
    assert [r.text for r in kept.rollouts] == ["0/0", "0/1", "10/0", "10/1"]
    assert [len(p) for p in kept.gen.prompt_routes] == [2, 3]
    # the learner's batch of the kept groups: each row after its own prompt
    batch = kept.train_batch(prompt_bucket=4, pad_id=0)
    ids = np.asarray(batch.input_ids)
    assert ids.shape == (4, 4 + M)
    assert ids[2, :4].tolist() == [0, 4, 5, 6] and ids[0, :4].tolist() == [0, 0, 1, 2]
    np.testing.assert_array_equal(ids[:, 4:], s.gen.tokens[[0, 1, 4, 5]])
    np.testing.assert_array_equal(np.asarray(batch.rewards), [0, 0, 0, 0])


def test_select_rows_keeps_each_rounds_prompt_routes():
    """A refilled group: state 0's first sample from round 1 and its second from round 2 (the
    same prompt text, forwarded again: another routing record of the prompt, here 7s instead
    of 0s). Each kept row points at its own round's prompt routes, and the learner's batch
    replays them (the prompt slots of row 1 hold 7s, of row 0 0s)."""
    from ace_jax.runtime.engine_programs import NO_ROUTE

    s = _step(0, [[1, 2], [3]], routes=True)
    more = _step(10, [[1, 2]], routes=True)
    more.gen = more.gen._replace(prompt_routes=(np.full((2, 1, 2), 7, np.uint8),))
    s.extend(more)
    kept = s.select_rows([[0, 4], [2, 3]])       # rows 0 (round 1) and 4 (round 2) of [1, 2]
    assert [r.text for r in kept.rollouts] == ["0/0", "10/0", "1/0", "1/1"]
    idx = kept.gen.prompt_index.tolist()
    assert kept.prompts[idx[0]] == kept.prompts[idx[1]] == [1, 2]
    assert kept.prompts[idx[2]] == kept.prompts[idx[3]] == [3]
    own = [kept.gen.prompt_routes[i] for i in idx]
    np.testing.assert_array_equal(own[0], np.zeros((2, 1, 2), np.uint8))
    np.testing.assert_array_equal(own[1], np.full((2, 1, 2), 7, np.uint8))
    np.testing.assert_array_equal(own[2], np.ones((1, 1, 2), np.uint8))
    np.testing.assert_array_equal(kept.gen.routes, s.gen.routes[[0, 4, 2, 3]])
    batch = kept.train_batch(prompt_bucket=4, pad_id=0)
    routes = np.asarray(batch.routes)                         # [4, 4 + M, 1, 2]
    assert (routes[:, :2] == NO_ROUTE).all()                  # left padding of the 2-token prompt
    assert (routes[0, 2:4] == 0).all() and (routes[1, 2:4] == 7).all()
    assert (routes[2:, 3] == 1).all() and (routes[2:, 2] == NO_ROUTE).all()
    np.testing.assert_array_equal(routes[:, 4:], s.gen.routes[[0, 4, 2, 3]])
    with pytest.raises(ValueError, match="one prompt"):
        s.select_rows([[0, 2]])                               # prompts [1, 2] and [3]
