"""A distillation teacher that would fail mid-run is refused at plan time with the key named (issue 47
item 5): truncated or NaN weights, a tokenizer.json that is no tokenizer, a context shorter than the
run's sequences. Teachers are real ``save_pretrained`` directories, damaged as a bad copy or a broken
conversion would damage them; the non-finite scan is checked against ``torch.isfinite`` per dtype."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from launcher.model_path import explicit_model_keys, resolve_model_path
from launcher.plan import PlanError
from launcher.teacher import check_teacher
from tests.conftest import compose
from tests.helpers.cli import slurmrl
from tests.models.hf_dirs import llama_dir
from workers.models import weight_integrity
from workers.models.weight_integrity import nonfinite_count

torch.set_num_threads(1)
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("student") / "s", tokenizer_vocab=100)


def teacher(tmp_path, **overrides):
    directory = llama_dir(tmp_path / "teacher", seed=1, **overrides)
    return directory


def cfg(student, teacher_dir):
    o = [f"model.path={student}", "algorithm=on_policy_distill", f"algorithm.teacher.path={teacher_dir}"]
    return resolve_model_path(compose(o), explicit_model_keys(o))


def poison(directory, name="model.layers.1.mlp.up_proj.weight", index=(3, 5), value=float("nan")):
    tensors = load_file(directory / WEIGHTS)
    tensors[name][index] = value
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})
    return name


def test_a_healthy_teacher_passes(tmp_path, student):
    check_teacher(cfg(student, teacher(tmp_path)))


def test_a_truncated_weight_file_is_refused(tmp_path, student):
    t = teacher(tmp_path)
    path = t / WEIGHTS
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(PlanError, match=r"algorithm.teacher.path: .*model.safetensors: truncated \(\d+ bytes"):
        check_teacher(cfg(student, t))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_teacher_weights_are_refused_naming_the_tensor(tmp_path, student, value):
    t = teacher(tmp_path)
    name = poison(t, value=value)
    with pytest.raises(PlanError, match=f"algorithm.teacher.path: .*tensor '{name}' holds NaN or infinite") as e:
        check_teacher(cfg(student, t))
    assert "sample" not in str(e.value)  # a tiny checkpoint is scanned whole


def test_a_large_checkpoint_is_sampled_and_says_so(tmp_path, student, monkeypatch):
    t = teacher(tmp_path)
    name = "model.embed_tokens.weight"  # 128 x 32 float32 = 16 KiB
    monkeypatch.setattr(weight_integrity, "FULL_SCAN_BYTES", 1)
    monkeypatch.setattr(weight_integrity, "SAMPLE_BYTES", 1024)  # windows of 256 values at start, middle, end
    poison(t, name, index=(64, 10))  # row 64 of 128: the middle window
    with pytest.raises(PlanError, match=f"tensor '{name}' holds NaN.*a sample of every tensor was read"):
        check_teacher(cfg(student, t))
    clean = llama_dir(tmp_path / "between", seed=1)
    poison(clean, name, index=(40, 0))  # between the windows: sampling misses it (the documented trade-off)
    check_teacher(cfg(student, clean))


@pytest.mark.parametrize("content", ['{"version": "1.0"}', "[1, 2, 3]", "not json", '{"model": {"vocab": 3}}'])
def test_a_tokenizer_json_that_is_not_a_tokenizer_is_refused(tmp_path, student, content):
    t = teacher(tmp_path)
    (t / "tokenizer.json").write_text(content)
    with pytest.raises(PlanError, match=r"algorithm.teacher.path: .*tokenizer.json: (not a tokenizer|not valid JSON)"):
        check_teacher(cfg(student, t))


def test_a_teacher_context_shorter_than_the_sequences_is_refused(tmp_path, student):
    t = teacher(tmp_path, max_position_embeddings=64)  # the student's is 128
    with pytest.raises(PlanError, match=r"teacher's max_position_embeddings is 64 .* sequences reach 128 tokens "
                                        r"\(model.max_position_embeddings\)"):
        check_teacher(cfg(student, t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_byte_scan_counts_what_torch_isfinite_counts(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4099, generator=g) * 100).to(dtype)
    if dtype == torch.float8_e4m3fn:  # no infinities in e4m3fn: NaN is S.1111.111
        x[[5, 700]] = float("nan")
    else:
        x[[5, 700, 4098]] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    raw = x.view(torch.uint8).numpy().tobytes()
    name = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
            torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}[dtype]
    assert nonfinite_count(raw, name) == int((~torch.isfinite(x.float())).sum()) > 0
    assert nonfinite_count(raw, "I64") == 0


def test_the_cli_refuses_a_nan_teacher_before_writing_a_run(tmp_path, student):
    t = teacher(tmp_path)
    poison(t)
    out = slurmrl([f"model.path={student}", "algorithm=on_policy_distill", f"algorithm.teacher.path={t}",
                   f"launcher.run_dir={tmp_path / 'no'}"], tmp_path)
    assert out.returncode != 0
    assert "algorithm.teacher.path: " in out.stderr + out.stdout and "holds NaN" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr and not (tmp_path / "no").exists()
