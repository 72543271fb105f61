"""The cached trainer under FSDP2 against DDP on the same GPUs: the same first loss and gradient norm, and a
standard checkpoint.

Two ``torchrun`` launches of ``gradcache-sparton train`` from the shipped SPLADE-tiny on the shipped pairs,
identical but for the data parallelism: DDP, then FSDP2 (``--fsdp full_shard`` with ``fsdp_version`` 2,
each ``BertLayer`` a unit). fp32 with TF32 off by default, so that the two differ only by summation order;
``--bf16`` runs both in bf16 (FSDP2's mixed precision then keeps bf16 parameters, DDP's autocast fp32 ones:
expect differences of bf16's size). Logged every step, ``--max_steps`` steps, dropout as the model has it
(every rank draws the same masks in both runs: same seed, same rows).

Checks (exit status 1 when one fails):
- step 1's loss (before any update) and gradient norm agree within ``--rtol`` (1e-4 in fp32: the ranks'
  reduce order and the gathered loss differ only in rounding);
- the FSDP2 run wrote standard masked-LM checkpoints (the final model and ``checkpoint-N``) that
  ``AutoModelForMaskedLM`` loads with every tensor, with weights equal to the DDP run's final weights
  within ``--weight_rtol`` of each tensor's largest entry after ``--max_steps`` identical updates.

Run on a machine with 2 GPUs, from the repository root:

    PYTHONPATH=$PWD python benchmarks/check_fsdp_trainer.py --out $OUT/fsdp_trainer.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SHARDING = {
    "ddp": [],
    "fsdp2": [
        "--fsdp",
        "full_shard auto_wrap",
        "--fsdp_config",
        json.dumps({"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]}),
    ],
}


def launch(name: str, work: Path, args: argparse.Namespace) -> dict:
    """One training run; its log history (loss and grad norm per step)."""
    out = work / name
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.gpus)]
    command += ["-m", "gradcache_sparton.cli", "train", "--model_name_or_path", "splade-tiny-msmarco"]
    command += [
        "--per_device_train_batch_size",
        "32",
        "--mini_batch_size",
        "8",
        "--max_steps",
        str(args.max_steps),
    ]
    command += ["--learning_rate", "1e-4", "--logging_steps", "1", "--eval_beir", "none", "--seed", "42"]
    command += ["--save_strategy", "steps", "--save_steps", str(args.max_steps), "--report_to", "none"]
    command += ["--output_dir", str(out)]
    command += ["--bf16", "True"] if args.bf16 else ["--tf32", "False"]
    command += SHARDING[name]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    (work / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{name} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    checkpoint = out / f"checkpoint-{args.max_steps}"
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {
        "history": [h for h in history if "loss" in h],
        "output_dir": str(out),
        "checkpoint": str(checkpoint),
    }


def compare_weights(ddp_dir: str, fsdp_dir: str) -> dict:
    """The FSDP2 run's saved weights (final model and last checkpoint, both standard checkpoints) against
    the DDP run's final ones: tensors missing from its files, and the largest difference relative to each
    tensor's largest entry."""
    from transformers import AutoModelForMaskedLM

    ddp = AutoModelForMaskedLM.from_pretrained(ddp_dir).state_dict()
    fsdp_model, info = AutoModelForMaskedLM.from_pretrained(fsdp_dir, output_loading_info=True)
    fsdp = fsdp_model.state_dict()
    worst = max(
        float((fsdp[k] - ddp[k]).abs().max()) / max(float(ddp[k].abs().max()), 1e-12)
        for k in ddp
        if k in fsdp
    )
    return {"missing_keys": list(info["missing_keys"]), "max_relative_weight_difference": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--rtol", type=float, default=1e-4, help="step 1's loss and gradient norm")
    # Adam divides each gradient by its own running size: a rounding-level gradient difference becomes a
    # difference of up to lr per step in entries whose gradient is near zero (3 steps of 1e-4 here).
    parser.add_argument("--weight_rtol", type=float, default=1e-3, help="final weights, per tensor's largest")
    parser.add_argument("--timeout_s", type=int, default=240)
    args = parser.parse_args()
    work = args.out.parent / "fsdp_runs"
    work.mkdir(parents=True, exist_ok=True)
    runs = {name: launch(name, work, args) for name in SHARDING}
    first = {name: run["history"][0] for name, run in runs.items()}
    report: dict = {"first_step": first, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    checks = {}
    for key in ("loss", "grad_norm"):
        a, b = float(first["ddp"][key]), float(first["fsdp2"][key])
        checks[f"step 1 {key}"] = abs(a - b) <= args.rtol * abs(a)
    for label, folder in (("final model", "output_dir"), ("checkpoint", "checkpoint")):
        weights = compare_weights(runs["ddp"]["output_dir"], runs["fsdp2"][folder])
        report[f"weights, {label}"] = weights
        checks[f"{label}: standard checkpoint, every tensor"] = not weights["missing_keys"]
        checks[f"{label}: weights equal DDP's final ones"] = (
            weights["max_relative_weight_difference"] <= args.weight_rtol
        )
    report["checks"] = checks
    report["passed"] = all(checks.values())
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
