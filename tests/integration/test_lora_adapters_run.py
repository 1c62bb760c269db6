"""Two LoRA adapters trained in one real local run on one frozen base (issue 44 item 5): launcher ->
trainer + 2 embedded workers + orchestrator, tiny dense model on CPU.

The two tasks conflict (tests/helpers/answer_token_env.py: answer an EVEN digit / an ODD digit, same
prompts), so a single shared policy has reward_even + reward_odd <= 1 in expectation; each adapter is an
env=mix entry of its name, its requests carry its name and its rows train only it. Checked: both
adapters' rewards rise over the run and end far above what one policy could reach on both; every step
publishes one PEFT directory per adapter whose digests the workers confirmed (nothing unconfirmed); the
engine's per-row adapters give the trainer's log-probs (mismatch_kl ~ 0 with both adapters in one batch).
"""
from __future__ import annotations

import json

import numpy as np

from tests.integration.conftest import assert_no_children_left, metrics, slurmrl

ENV = """defaults:
  - /schema/env/mix@_here_
  - _self_
name: mix
weights: {even: 1.0, odd: 1.0}
envs:
  even: {name: target, _target_: "tests.helpers.answer_token_env:AnswerParity", args: {parity: 0}}
  odd: {name: target, _target_: "tests.helpers.answer_token_env:AnswerParity", args: {parity: 1}}
"""
STEPS = 16


def test_two_adapters_each_learn_their_own_task(tmp_path):
    conf = tmp_path / "conf"
    (conf / "env").mkdir(parents=True)
    (conf / "env" / "even_odd.yaml").write_text(ENV)
    run_dir = tmp_path / "adapters"
    slurmrl([f"hydra.searchpath=[file://{conf}]", "model=tiny_dense", "env=even_odd", "trainer.lora.rank=4",
             "trainer.lora.alpha=16", "trainer.lr=5e-2", "trainer.lora.adapters=[even,odd]",
             f"trainer.num_steps={STEPS}", "orchestrator.num_prompts_per_step=8", "orchestrator.num_samples_per_prompt=8",
             "orchestrator.max_inflight_rollouts=128", "orchestrator.max_off_policy_steps=0", "weights.keep_last=50",
             f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert r["weight_updates_unconfirmed"] == 0 and r["samples_dropped_unconfirmed_total"] == 0, r
        if r["samples/even"] and r["samples/odd"]:  # both adapters in one batch, each row on its own
            assert r["mismatch_kl"] < 1e-6, r["mismatch_kl"]

    def mean(name, rows):  # sample-weighted: a step's batch may hold few groups of one adapter
        n = np.array([r[f"samples/{name}"] for r in rows])
        return float(np.nansum([r[f"reward/{name}"] * k for r, k in zip(rows, n) if k]) / max(n.sum(), 1))
    first, last = recs[:4], recs[-4:]
    rewards = {a: (mean(a, first), mean(a, last)) for a in ("even", "odd")}
    for a, (start, end) in rewards.items():
        assert end > start + 0.15, rewards
    print("rewards (first 4 steps, last 4 steps):", rewards)
    # one shared policy: even + odd <= 1 in expectation (~130 samples per adapter: +-0.06 on the sum)
    assert sum(end for _, end in rewards.values()) > 1.15, rewards
    weights = run_dir / "weights"
    side = json.loads((weights / f"step_{STEPS - 1:06d}" / "slurmrl_adapter.json").read_text())
    assert sorted(side["adapters"]) == ["even", "odd"] and side["adapters"]["even"] != side["adapters"]["odd"]
    for a in ("even", "odd"):
        d = weights / f"step_{STEPS - 1:06d}" / "adapters" / a
        assert (d / "adapter_config.json").is_file() and (d / "adapter_model.safetensors").is_file()
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("inference*.log"))
    assert f"loaded adapters v{STEPS - 1} ['even', 'odd'], step digest {side['digest']}" in logs
    assert_no_children_left(run_dir)
