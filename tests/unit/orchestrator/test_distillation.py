"""The reference / teacher scoring path (workers/orchestrator/scoring.py), on-policy distillation's
advantages (buffer.py), the batch's ``ref_logprobs`` and the launcher's teacher check (launcher/teacher.py).

The teacher's log-probs are checked against transformers scoring the same Hugging Face checkpoint,
the reference's against the trainer's own scoring of the same weights; both at the sampling temperature.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from launcher.model_path import explicit_model_keys, resolve_model_path
from launcher.plan import PlanError
from launcher.teacher import check_teacher
from tests.conftest import compose
from tests.integration import test_parity_parallel as moe
from tests.models.hf_dirs import llama_dir
from workers.common.protocol import RunPaths
from workers.orchestrator.batch_builder import write_batch
from workers.orchestrator.buffer import RolloutBuffer, RolloutGroup, Sample
from workers.orchestrator.scoring import REFERENCE_FILE, PolicyScorer, reference_scorer, teacher_scorer
from workers.trainer.batch import load_batch
from workers.trainer.loss import token_logprobs
from workers.weights.filesystem.publisher import publish_step

torch.set_num_threads(1)
TEMPERATURE = 0.8


def group(prompts=((1, 2, 3), (4, 5)), completions=((6, 7), (8, 9, 10)), logprobs=None) -> RolloutGroup:
    samples = [Sample(prompt_ids=list(p), completion_ids=list(c), completion_logprobs=list(logprobs[i]) if logprobs
                      else [-1.0] * len(c), token_versions=[0] * len(c), reward=float(i), finish_reason="stop")
               for i, (p, c) in enumerate(zip(prompts, completions))]
    return RolloutGroup(group_id=0, task_id=0, samples=samples)


def test_scorer_matches_the_trainers_scoring_of_the_same_weights():
    model = moe.build_model(moe.CFG, moe.SEED)
    g = group()
    got = PolicyScorer(model, TEMPERATURE, "reference").score(g)
    for s, lp in zip(g.samples, got):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            ref, _ = token_logprobs(model(ids).logits, ids, TEMPERATURE)
        assert np.allclose(lp, ref[0, len(s.prompt_ids):].numpy(), atol=1e-5), (lp, ref)


def test_teacher_from_a_hf_checkpoint_scores_as_transformers_does(tmp_path):
    from transformers import AutoModelForCausalLM

    teacher = llama_dir(tmp_path / "teacher", seed=3, vocab_size=16)
    cfg = compose(["algorithm=on_policy_distill", f"algorithm.teacher.path={teacher}",
                   f"orchestrator.temperature={TEMPERATURE}"])
    g = group()
    got = teacher_scorer(cfg).score(g)
    hf = AutoModelForCausalLM.from_pretrained(teacher).eval()
    for s, lp in zip(g.samples, got):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, :-1] / TEMPERATURE, -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert np.allclose(lp, logp[len(s.prompt_ids) - 1:].numpy(), atol=1e-5)


def test_distillation_advantages_and_reverse_kl_by_hand():
    """advantage_t = log pi_teacher - log pi_sampled (+ reward_weight x task advantage)."""
    for weight, expect in ((0.0, [[0.5, -1.0], [0.0, 0.0, 2.0]]), (0.5, [[0.25, -1.25], [0.25, 0.25, 2.25]])):
        g = group(logprobs=([-1.5, -1.0], [-2.0, -2.0, -3.0]))
        for s, t in zip(g.samples, ([-1.0, -2.0], [-2.0, -2.0, -1.0])):
            s.teacher_logprobs = np.array(t, np.float32)
        buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=1, distill_reward_weight=weight)
        buf.add(g)  # task rewards 0 and 1: centred advantages -0.5 and 0.5
        assert [s.token_advantages.tolist() for s in g.samples] == expect
    # reverse KL estimate over the sampled tokens: mean(log pi_sampled - log pi_teacher)
    assert buf.sampling_metrics([g])["teacher_reverse_kl"] == pytest.approx((-0.5 + 1.0 + 0 + 0 - 2.0) / 5)


def test_reference_logprobs_travel_in_the_batch(tmp_path):
    g = group()
    for i, s in enumerate(g.samples):
        s.ref_logprobs = np.array([-0.5 - i] * len(s.completion_ids), np.float32)
    paths = RunPaths(tmp_path)
    RolloutBuffer(max_off_policy_steps=0, groups_per_step=1).add(g)
    write_batch(paths, 1, [g], num_layers=0, top_k=0, temperature=1.0, extra_metrics={})
    batch = load_batch(paths.rollouts(1), step=1, num_layers=0, top_k=0, num_experts=0)
    assert torch.equal(batch.ref_logprobs[batch.loss_mask], torch.tensor([-0.5, -0.5, -1.5, -1.5, -1.5]))
    assert not batch.ref_logprobs[~batch.loss_mask].any()
    g.samples[0].ref_logprobs = None  # not every sample scored: no column (the trainer adds no KL)
    write_batch(paths, 2, [g], num_layers=0, top_k=0, temperature=1.0, extra_metrics={})
    assert load_batch(paths.rollouts(2), step=2, num_layers=0, top_k=0, num_experts=0).ref_logprobs is None


def test_the_launcher_refuses_a_teacher_with_another_tokenizer(tmp_path):
    student = llama_dir(tmp_path / "student", tokenizer_vocab=100)
    same = llama_dir(tmp_path / "same", seed=1, hidden_size=64, intermediate_size=96)
    for f in student.glob("*token*"):  # the student's tokenizer files (a retrained BPE numbers its ids anew)
        shutil.copy(f, same / f.name)
    other = llama_dir(tmp_path / "other", seed=1, tokenizer_vocab=110)
    bigger_vocab = llama_dir(tmp_path / "bigger", vocab_size=256)
    def cfg(teacher):
        o = [f"model.path={student}", "algorithm=on_policy_distill", f"algorithm.teacher.path={teacher}"]
        return resolve_model_path(compose(o), explicit_model_keys(o))

    check_teacher(cfg(same))  # another size, the student's tokenizer: fine
    with pytest.raises(PlanError, match="its tokenizer differs from the student's"):
        check_teacher(cfg(other))
    with pytest.raises(PlanError, match="the teacher's vocab_size is 256.*model.vocab_size is 128"):
        check_teacher(cfg(bigger_vocab))
    with pytest.raises(PlanError, match="algorithm.teacher.path: .*missing is not a directory"):
        check_teacher(cfg(tmp_path / "missing"))


def test_the_reference_outlives_the_pruning_of_step_0(tmp_path):
    """The reference is read from the published weights/step_0 once and kept in the run directory: a
    restarted orchestrator scores against the same step-0 policy after weights.keep_last deleted it."""
    cfg = compose(["model=tiny_dense", "trainer.kl_coef=0.1"])
    model = moe.build_model(cfg.model, 0)
    publish_step(tmp_path / "weights", 0, model.state_dict(), keep_last=2)
    step0 = tmp_path / "weights" / "step_000000"
    g = group()
    first = reference_scorer(cfg, step0, tmp_path).score(g)
    assert (tmp_path / REFERENCE_FILE).is_file()
    for s, lp in zip(g.samples, first):  # the published weights are the model's: its own scoring
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            ref, _ = token_logprobs(model(ids).logits, ids, cfg.orchestrator.temperature)
        assert np.allclose(lp, ref[0, len(s.prompt_ids):].numpy(), atol=1e-5)
    shutil.rmtree(step0)
    again = reference_scorer(cfg, step0, tmp_path).score(g)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
