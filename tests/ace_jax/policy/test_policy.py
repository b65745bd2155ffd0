"""ace_jax.policy.policy: JaxPolicy.from_run against a real tiny run directory, and policy specs."""
import numpy as np
import pytest

from ace_jax.policy.interface import PolicyError
from ace_jax.policy.openai_policy import OpenAIPolicy
from ace_jax.policy.policy import JaxPolicy
from ace_jax.policy.runs import read_run_config
from models.qwen3 import flat_params
from tests.run_fixture import make_tiny_run

CONV = [{"role": "user", "content": "print the metric"}]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("policy") / "run")
    model, tokenizer = make_tiny_run(workdir)
    return workdir, model, tokenizer


# ----------------------------------------------------------------------------------- JaxPolicy


def test_from_run_restores_exactly_the_saved_weights(tiny_run):
    workdir, model, tokenizer = tiny_run
    policy = JaxPolicy.from_run(workdir, max_new_tokens=4)
    assert policy.name == "run@1"
    saved, restored = flat_params(model), flat_params(policy.model)
    assert saved.keys() == restored.keys()
    for k in saved:
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(saved[k]), err_msg=k)
    assert len(policy.tokenizer) == len(tokenizer)
    out = policy.complete([CONV])
    assert len(out) == 1 and out[0].ok and out[0].completion_tokens == len(out[0].token_ids) <= 4
    assert out[0].prompt_tokens == len(policy.encode(CONV)[0])


def test_missing_run_dir_and_config_raise_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="does not exist"):
        JaxPolicy.from_run(str(tmp_path / "nope"))
    with pytest.raises(PolicyError, match="no config.json"):
        JaxPolicy.from_run(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PolicyError, match="unreadable"):
        JaxPolicy.from_run(str(tmp_path))
    (tmp_path / "config.json").write_text('{"agent": {}}')
    with pytest.raises(PolicyError, match="no 'model' section"):
        read_run_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model": {"d": 1}, "agent": {}}')
    assert read_run_config(tmp_path) == {"model": {"d": 1}, "agent": {}}


# ----------------------------------------------------------------------------------- specs


def test_policy_spec_errors_are_typed():
    from ace_jax.policy import policy

    parse = policy.parse_policy_spec
    assert parse("run:runs/a@7") == ("run", {"workdir": "runs/a", "step": 7})
    assert parse("run:runs/local") == ("run", {"workdir": "runs/local", "step": None})
    assert parse("run:runs/a@b/x@200") == ("run", {"workdir": "runs/a@b/x", "step": 200})
    assert parse("hf:/m/Qwen3") == ("hf", {"path": "/m/Qwen3"})
    assert parse("openai:http://h:8000/v1#qwen") == (
        "openai", {"base_url": "http://h:8000/v1", "model": "qwen"})
    assert parse("openai:https://h/v1")[1]["model"] == "default"
    for bad in ("", "runs/local", "gpt:x", "openai:h/v1#m", "hf:"):
        with pytest.raises(policy.PolicySpecError, match="policy") as info:
            parse(bad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, PolicyError)
        with pytest.raises(policy.PolicySpecError):
            policy.policy_from_spec(bad)


def test_policy_from_spec_builds_an_openai_policy_with_the_given_sampling():
    from ace_jax.policy import policy

    p = policy.policy_from_spec("openai:http://127.0.0.1:9/v1#m", max_new_tokens=7,
                                temperature=0.3)
    assert isinstance(p, OpenAIPolicy)
    assert (p.model, p.max_tokens, p.temperature) == ("m", 7, 0.3)


def test_policy_from_spec_of_a_run_takes_the_runs_sampling(tiny_run):
    from ace_jax.policy import policy

    workdir = tiny_run[0]
    cfg = read_run_config(workdir)
    p = policy.policy_from_spec(f"run:{workdir}", temperature=0.5)
    assert isinstance(p, JaxPolicy) and p.sampling.temperature == 0.5
    assert p.sampling.max_new_tokens == cfg["sampling"]["max_new_tokens"]


def test_jax_policy_is_safe_to_call_from_threads(tiny_run):
    """An evaluation calls the implementer and its advisor (both JAX policies) from episode
    threads; unserialised, calls shared one engine and failed (lost requests, donated buffers
    read after deletion). Each thread gets what a call alone gives."""
    import concurrent.futures

    policy = JaxPolicy.from_run(tiny_run[0], max_new_tokens=6, temperature=1.0)
    convs = [[{"role": "user", "content": f"task {i}: print the metric"}] for i in range(8)]
    alone = [policy.complete([c], seed=i)[0] for i, c in enumerate(convs)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda i: policy.complete([convs[i]], seed=i)[0], range(8)))
    assert all(c.ok for c in threaded)
    assert [c.token_ids for c in threaded] == [c.token_ids for c in alone]
