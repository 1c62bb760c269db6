"""reverse_digits: deterministic prompts, reward = fraction of correct positions."""
from workers.common.config import EnvConfig
from workers.orchestrator.envs import make_env
from workers.orchestrator.envs.reverse_digits import EOS, ReverseDigitsConfig
import pytest


def env(**kw):
    return make_env(ReverseDigitsConfig(**kw), seed=0)


def test_prompts_are_deterministic_from_seed():
    a, b = env(), env()
    assert [a.sample_task() for _ in range(5)] == [b.sample_task() for _ in range(5)]


def test_reward_is_fraction_of_correct_positions():
    e = env(min_digits=3, max_digits=3)
    t = e.sample_task()
    target = list(t.target_ids)
    assert e.score(t, target + [EOS]) == 1.0
    assert e.score(t, [target[0], 99, target[2], EOS]) == pytest.approx(2 / 3)
    assert e.score(t, target + target + [EOS]) == pytest.approx(0.5)  # rambling is penalised
    assert e.score(t, []) == 0.0
    assert sum(e.token_rewards(t, target + [EOS])) == pytest.approx(1.0)


def test_unknown_env_lists_choices():
    with pytest.raises(ValueError, match="reverse_digits"):
        make_env(EnvConfig(name="nope"), seed=0)
