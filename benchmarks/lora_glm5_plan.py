"""GLM-5's 28 x H200 plan with and without LoRA: trainer memory per GPU and the cost of one weight update,
from the launcher's own plan functions (torch-free: this is what ``slurmrl experiment=glm5_swe_28xh200
cluster=h200_ib launcher.dry_run=true trainer.lora.rank=32`` prints, as numbers).

    python -m benchmarks.lora_glm5_plan          # prints both plans' numbers (benchmarks.lora records them)

Why a LoRA variant of the layout: LoRA runs on the FSDP plan (tp = ep = 1: launcher/lora_plan.py
refuses ep > 1), so the preset's ``ep 8 x cp 16`` becomes ``dp 8 x cp 16`` on the same 128 trainer
GPUs; the learning rate is the preset's x10 (a LoRA run at a full-fine-tuning lr gets the plan's
warning). Everything else (nodes, servers, sequence length, activations) is the preset's.

Full fine-tuning's update is the preset's transport (broadcast, sparse patches into SGLang at the
assumed changed fraction) and, for reference, the dense broadcast of the whole bf16 model; LoRA's is
the adapter, read from the shared filesystem by every server at ``cluster.shared_fs_gb_s``
(launcher/lora_plan.py update_line).
"""
from __future__ import annotations

import sys

PRESET = ["experiment=glm5_swe_28xh200", "cluster=h200_ib"]
LORA_RANK = 32
LR_SCALE = 10.0


def lora_overrides(cfg, rank: int = LORA_RANK) -> list[str]:
    """The preset's layout made LoRA's: ep folded into dp (same ranks), lr x10, ``trainer.lora.rank``."""
    par = cfg.trainer.parallel
    return [f"trainer.lora.rank={rank}", "trainer.parallel.ep=1", "trainer.parallel.tp=1",
            f"trainer.parallel.dp={par.dp * par.ep * par.tp}", f"trainer.lr={cfg.trainer.lr * LR_SCALE:g}"]


def _trainer_estimate(plan):
    return next(m for m in plan.memory if m.what == "trainer")


def full_numbers(cfg, plan) -> dict:
    from launcher.estimate import DTYPE_BYTES, trainer_memory
    from workers.weights.sglang.patch_cost import delta_update_cost, model_split, server_layouts
    from workers.weights.sglang.wire import update_cost

    ranks, dtype, nic = cfg.trainer.num_ranks, cfg.inference.dtype, cfg.cluster.nic_gb_s
    dense_bytes, dense_s = update_cost(plan.params.total * DTYPE_BYTES[dtype], nic)
    out = {"lr": cfg.trainer.lr, "trainer_ranks": ranks, "trainer_dims": plan.trainer_dims.describe(),
           "trainer_states_gb_per_gpu": trainer_memory(plan.params, ranks, cfg.cluster.gpu_memory_gb,
                                                       cfg.trainer.master_dtype).per_gpu_gb,
           "trainer_total_gb_per_gpu": _trainer_estimate(plan).per_gpu_gb,
           "update_dense_bytes": dense_bytes, "update_dense_broadcast_s": dense_s,
           "transport": cfg.weights.transport, "weights_delta": bool(getattr(cfg.weights, "delta", False)),
           "plan_weights_line": plan.weight_update, "plan_memory_line": _trainer_estimate(plan).detail}
    if out["weights_delta"]:
        c = delta_update_cost(model_split(cfg.model), server_layouts(cfg), item_bytes=DTYPE_BYTES[dtype],
                              fraction=cfg.weights.delta_fraction_assumed, nic_gb_s=nic, senders=ranks)
        out.update(update_patch_bytes_per_gpu=c.whole_bytes_per_gpu, update_patch_s=c.whole_s,
                   patch_fraction_assumed=c.fraction)
    return out


def lora_numbers(cfg, plan) -> dict:
    from launcher import lora_plan
    from launcher.estimate import DTYPE_BYTES

    f, ranks = lora_plan.lora_facts(cfg), cfg.trainer.num_ranks
    adapter_bytes = f.published * DTYPE_BYTES[cfg.trainer.dtype]
    fs = cfg.cluster.shared_fs_gb_s
    return {"rank": cfg.trainer.lora.rank, "alpha": cfg.trainer.lora.alpha, "targets": list(cfg.trainer.lora.targets),
            "experts": cfg.trainer.lora.experts, "lr": cfg.trainer.lr, "trainer_ranks": ranks,
            "trainer_dims": plan.trainer_dims.describe(), "trainable_params": f.trainable,
            "published_params": f.published, "base_params": f.base,
            "trainer_states_gb_per_gpu": lora_plan.trainer_memory(cfg, ranks, cfg.cluster.gpu_memory_gb).per_gpu_gb,
            "trainer_total_gb_per_gpu": _trainer_estimate(plan).per_gpu_gb,
            "update_adapter_bytes": adapter_bytes, "update_read_s": adapter_bytes / (fs * 1e9),
            "shared_fs_gb_s": fs, "plan_lora_line": plan.lora, "plan_weights_line": plan.weight_update,
            "plan_memory_line": _trainer_estimate(plan).detail,
            "warnings": list(plan.trainer_dims.warnings)}


def smallest_lora_trainer(base_cfg, extra: list[str]) -> dict:
    """The fewest trainer nodes that hold the LoRA run (states + the preset's activations within the plan's
    fit fraction): dp 1, 2, 4... at the preset's cp, the other components unchanged."""
    from launcher.plan import build_plan
    from launcher.resources import PlanError
    from tools.simulator.cli import compose

    par, per_node = base_cfg.trainer.parallel, base_cfg.cluster.num_gpus_per_node
    other_nodes = base_cfg.launcher.num_gpu_nodes - base_cfg.launcher.trainer.num_nodes
    dp = 1
    while dp <= par.dp * par.ep:
        ranks = par.cp * dp
        nodes = -(-ranks // per_node)
        over = [*extra, f"trainer.parallel.dp={dp}", f"trainer.num_ranks={ranks}", f"launcher.trainer.num_nodes={nodes}",
                f"launcher.num_gpu_nodes={other_nodes + nodes}"]
        try:
            est = _trainer_estimate(build_plan(compose([*PRESET, *over])))
        except PlanError:
            est = None
        if est is not None and est.fits:
            return {"trainer_ranks": ranks, "trainer_nodes": nodes, "job_gpu_nodes": other_nodes + nodes,
                    "trainer_total_gb_per_gpu": est.per_gpu_gb, "overrides": over}
        dp *= 2
    return {}


def glm5_plans(rank: int = LORA_RANK) -> dict:
    """Both plans' numbers and their ratios (LoRA over full), and the smallest trainer LoRA fits."""
    from launcher.plan import build_plan
    from tools.simulator.cli import compose  # dry-run composition, as the simulator plans presets

    base_cfg = compose(PRESET)
    full = full_numbers(base_cfg, build_plan(base_cfg))
    extra = lora_overrides(base_cfg, rank)
    lora_cfg = compose([*PRESET, *extra])
    lora = lora_numbers(lora_cfg, build_plan(lora_cfg))
    return {"command": "slurmrl " + " ".join([*PRESET, "launcher.dry_run=true", *extra]),
            "model": f"{base_cfg.model.name} (family {base_cfg.model.family})", "full": full, "lora": lora,
            "states_lora_over_full": lora["trainer_states_gb_per_gpu"] / full["trainer_states_gb_per_gpu"],
            "total_lora_over_full": lora["trainer_total_gb_per_gpu"] / full["trainer_total_gb_per_gpu"],
            "update_bytes_lora_over_dense": lora["update_adapter_bytes"] / full["update_dense_bytes"],
            "preset_trainer_nodes": base_cfg.launcher.trainer.num_nodes,
            "preset_job_gpu_nodes": base_cfg.launcher.num_gpu_nodes,
            "lora_smallest_trainer": smallest_lora_trainer(base_cfg, extra)}


def _dims(numbers: dict) -> str:
    return numbers["trainer_dims"].split(" = ")[0]


def summary_lines(p: dict) -> list[str]:
    f, lo = p["full"], p["lora"]
    patch = (f", sparse patches {f['update_patch_bytes_per_gpu'] / 1e9:.1f} GB ~{f['update_patch_s']:.2f} s "
             f"(assumed {f['patch_fraction_assumed']:g} changed)" if f.get("weights_delta") else "")
    lines = [f"GLM-5 plan ({p['model']}, {f['trainer_ranks']} trainer H200s):",
            f"  full FT  [{_dims(f)}]: states {f['trainer_states_gb_per_gpu']:.1f} GB/GPU, with activations "
            f"{f['trainer_total_gb_per_gpu']:.1f} GB/GPU; update dense {f['update_dense_bytes'] / 1e9:.0f} GB "
            f"~{f['update_dense_broadcast_s']:.1f} s broadcast{patch}",
            f"  LoRA r{lo['rank']} [{_dims(lo)}]: {lo['trainable_params'] / 1e9:.2f}B trainable; states "
            f"{lo['trainer_states_gb_per_gpu']:.1f} GB/GPU ({p['states_lora_over_full']:.2f}x), with activations "
            f"{lo['trainer_total_gb_per_gpu']:.1f} GB/GPU ({p['total_lora_over_full']:.2f}x); update adapter "
            f"{lo['update_adapter_bytes'] / 1e9:.1f} GB ({100 * p['update_bytes_lora_over_dense']:.2f}% of dense) "
            f"~{lo['update_read_s']:.2f} s at shared_fs_gb_s={lo['shared_fs_gb_s']:g}"]
    if small := p.get("lora_smallest_trainer"):
        lines.append(f"  LoRA fits {small['trainer_nodes']} trainer nodes ({small['trainer_ranks']} GPUs, "
                     f"{small['trainer_total_gb_per_gpu']:.1f} GB/GPU) instead of {p['preset_trainer_nodes']}: "
                     f"{small['job_gpu_nodes']} GPU nodes for the job instead of {p['preset_job_gpu_nodes']}")
    return lines


def main(argv=None) -> int:
    del argv
    print("\n".join(summary_lines(glm5_plans())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

