"""ace_jax.registry: one Registry type (and one error) for GRPO's parts, the samplers, the rewards."""
import pytest

from ace_jax.curriculum import learnability
from ace_jax.env import rewards
from ace_jax.registry import Registry, UnknownNameError
from ace_jax.rl import advantage_estimators, kl_estimators, loss_aggregation

# (registry, a name it must hold, how the public call site looks a name up)
REGISTRIES = {
    "advantage estimator": (advantage_estimators.ADVANTAGE_ESTIMATORS, "grpo",
                            advantage_estimators.ADVANTAGE_ESTIMATORS.get),
    "loss aggregation": (loss_aggregation.LOSS_AGGREGATIONS, "token_mean",
                         loss_aggregation.LOSS_AGGREGATIONS.get),
    "KL estimator": (kl_estimators.KL_ESTIMATORS, "k3",
                     lambda n: kl_estimators.kl_divergence(0.0, 0.0, n)),
    "sampler": (learnability.SAMPLERS, "lp",
                lambda n: learnability.get_spec(learnability.default_config(), n)),
    "reward": (rewards.REWARDS, "acegrpo_step", rewards.get_reward),
}


def test_one_type_and_one_error_everywhere():
    for reg, _, _ in REGISTRIES.values():
        assert type(reg) is Registry
    assert issubclass(UnknownNameError, KeyError)


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_unknown_name_lists_the_valid_ones(kind):
    reg, known, lookup = REGISTRIES[kind]
    assert known in reg and known in reg.names() and "nope" not in reg
    with pytest.raises(UnknownNameError) as e:
        lookup("nope")
    msg = str(e.value)
    assert msg.startswith("unknown ") and "'nope'" in msg
    assert msg.endswith("valid names: " + ", ".join(reg.names()))
    with pytest.raises(KeyError):  # old callers catching KeyError keep working
        reg.get("nope")


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_duplicate_registration_is_refused(kind):
    reg, known, _ = REGISTRIES[kind]
    before = reg.get(known)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(known)(lambda *a, **k: None)
    assert reg.get(known) is before


def test_public_register_functions_refuse_duplicates():
    for register, name in ((advantage_estimators.register_advantage_estimator, "rloo"),
                           (loss_aggregation.register_loss_aggregation, "token_mean"),
                           (kl_estimators.register_kl_estimator, "k1"),
                           (learnability.register_sampler, "uniform"),
                           (rewards.register_reward, "ideator_ternary")):
        with pytest.raises(ValueError, match="already registered"):
            register(name)(lambda *a, **k: None)


def test_registry_api():
    reg: Registry = Registry("thing")
    f = reg.register("b", aliases=("a",))(lambda: 1)
    assert f() == 1 and reg.get("a") is f and reg["b"] is f
    assert reg.names() == ["a", "b"] == list(reg) and len(reg) == 2 and set(reg) == {"a", "b"}
    assert reg.register("b", aliases=("a",))(f) is f          # the same function again: no-op
    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("c", aliases=("a",))(lambda: 2)
    assert "c" not in reg                                      # a refused registration adds nothing
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="non-empty str"):
            reg.register(bad)
    with pytest.raises(ValueError, match="repeated"):
        reg.register("d", aliases=("d",))
    with pytest.raises(UnknownNameError, match=r"unknown thing \['x'\]; valid names: a, b"):
        reg.get(["x"])                                         # unhashable: same error
    assert ["x"] not in reg
    assert str(UnknownNameError("plain")) == "plain" and str(UnknownNameError()) == ""
