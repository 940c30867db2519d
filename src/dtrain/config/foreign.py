"""Keys in another framework's vocabulary, answered with the dtrain key they mean.

A user coming from Hugging Face's Trainer, Accelerate, Lightning, nanoGPT or torchtitan writes the names
they know (`learning_rate`, `max_epochs`, `gradient_accumulation_steps`, ...). The nearest spelling among
dtrain's keys is often another setting altogether (`learning_rate` is closest to `optimizer.name`), so a
table says what each means. Only for keys dtrain does not have: a name looked up here is always unknown.
"""

from __future__ import annotations

# name → (dtrain's key, or a flag of its command line; whose name it is)
FOREIGN: dict[str, tuple[str, str]] = {
    "learning_rate": ("optimizer.lr", "Hugging Face, Accelerate, torchtitan"),
    "lr": ("optimizer.lr", "PyTorch, Lightning"),
    "num_train_epochs": ("training.epochs", "Hugging Face"),
    "num_epochs": ("training.epochs", "Accelerate's examples"),
    "max_epochs": ("training.epochs", "Lightning"),
    "epochs": ("training.epochs", "PyTorch's examples"),
    "max_steps": ("training.max_steps", "Hugging Face, Lightning"),
    "max_iters": ("training.max_steps", "nanoGPT"),
    "num_training_steps": ("training.max_steps", "Hugging Face"),
    "lr_scheduler": ("scheduler.name", "Accelerate, torchtitan"),
    "lr_scheduler_type": ("scheduler.name", "Hugging Face"),
    "warmup_steps": ("scheduler.warmup_steps", "Hugging Face, torchtitan"),
    "num_warmup_steps": ("scheduler.warmup_steps", "Hugging Face"),
    "warmup_iters": ("scheduler.warmup_steps", "nanoGPT"),
    "lr_decay_iters": ("scheduler.decay_steps", "nanoGPT"),
    "min_lr": ("scheduler.min_lr", "nanoGPT"),
    "per_device_train_batch_size": ("data.batch_size", "Hugging Face"),
    "train_batch_size": ("data.batch_size", "Accelerate's examples"),
    "micro_batch_size": ("data.batch_size", "Megatron"),
    "batch_size": ("data.batch_size", "PyTorch, nanoGPT"),
    "local_batch_size": ("data.batch_size", "torchtitan"),
    "per_device_eval_batch_size": ("data.eval_batch_size", "Hugging Face"),
    "eval_batch_size": ("data.eval_batch_size", "Accelerate's examples"),
    "global_batch_size": ("training.global_batch_size", "torchtitan, Megatron"),
    "gradient_accumulation_steps": ("training.grad_accum_steps", "Hugging Face, Accelerate, nanoGPT"),
    "accumulate_grad_batches": ("training.grad_accum_steps", "Lightning"),
    "max_grad_norm": ("training.max_grad_norm", "Hugging Face, torchtitan"),
    "gradient_clip_val": ("training.max_grad_norm", "Lightning"),
    "grad_clip": ("training.max_grad_norm", "nanoGPT"),
    "clip_grad_norm": ("training.max_grad_norm", "PyTorch"),
    "weight_decay": ("optimizer.weight_decay", "Hugging Face, nanoGPT"),
    "optim": ("optimizer.name", "Hugging Face"),
    "optimizer": ("optimizer.name", "Lightning, torchtitan"),
    "scheduler": ("scheduler.name", "Lightning, torchtitan"),
    "seed": ("run.seed", "Hugging Face, Lightning"),
    "output_dir": ("run.dir", "Hugging Face"),
    "default_root_dir": ("run.dir", "Lightning"),
    "out_dir": ("run.dir", "nanoGPT"),
    "dump_folder": ("run.dir", "torchtitan"),
    "mixed_precision": ("training.precision", "Accelerate, torchtitan"),
    "precision": ("training.precision", "Lightning"),
    "fp16": ("training.precision", "Hugging Face"),
    "bf16": ("training.precision", "Hugging Face"),
    "dtype": ("training.precision", "nanoGPT"),
    "logging_steps": ("training.log_every", "Hugging Face"),
    "log_every_n_steps": ("training.log_every", "Lightning"),
    "log_interval": ("training.log_every", "nanoGPT"),
    "log_freq": ("training.log_every", "torchtitan"),
    "eval_steps": ("training.eval_every_steps", "Hugging Face"),
    "eval_interval": ("training.eval_every_steps", "nanoGPT"),
    "val_check_interval": ("training.eval_every_steps", "Lightning"),
    "check_val_every_n_epoch": ("training.eval_every", "Lightning"),
    "eval_iters": ("training.eval_batches", "nanoGPT"),
    "save_steps": ("checkpoint.every_steps", "Hugging Face"),
    "save_total_limit": ("checkpoint.keep", "Hugging Face"),
    "keep_latest_k": ("checkpoint.keep", "torchtitan"),
    "resume_from_checkpoint": ("checkpoint.resume_from", "Hugging Face"),
    "ckpt_path": ("checkpoint.resume_from", "Lightning"),
    "init_from": ("model.init_from", "nanoGPT"),
    "dataloader_num_workers": ("data.num_workers", "Hugging Face"),
    "num_workers": ("data.num_workers", "PyTorch"),
    "gradient_checkpointing": ("training.activation_checkpointing", "Hugging Face"),
    "torch_compile": ("training.compile", "Hugging Face"),
    "compile": ("training.compile", "nanoGPT, torchtitan"),
    "report_to": ("monitor.trackers", "Hugging Face"),
    "log_with": ("monitor.trackers", "Accelerate"),
    "logger": ("monitor.trackers", "Lightning"),
    "data_dir": ("data.path", "nanoGPT's dataset"),
    "dataset": ("data.name", "nanoGPT, torchtitan"),
    "block_size": ("data.block_size", "nanoGPT"),
    "seq_len": ("data.block_size", "torchtitan"),
    "backend": ("distributed.backend", "PyTorch"),
    "strategy": ("parallel.strategy", "Lightning"),
    "tensor_parallel_degree": ("parallel.tp_size", "torchtitan"),
    "pipeline_parallel_degree": ("parallel.pp_size", "torchtitan"),
    "context_parallel_degree": ("parallel.cp_size", "torchtitan"),
    "devices": ("--nproc N", "Lightning"),
    "num_processes": ("--nproc N", "Accelerate"),
    "nproc_per_node": ("--nproc N", "torchrun"),
    "num_nodes": ("--nnodes N", "Lightning, Accelerate"),
}


def foreign_hint(key: str, nearest: str | None = None) -> str | None:
    """For an unknown `section.key` (or a bare name): what dtrain calls it, or None — also where the nearest
    spelling (`nearest`: a misspelt section, `trainig.epochs`) already names that key. The last part of the
    key is looked up, in any section: `[optimizer] learning_rate` and `training.learning_rate` alike."""
    name = key.rpartition(".")[2].strip().lower()
    meaning = FOREIGN.get(name)
    if meaning is None or meaning[0] in (key, nearest):
        return None
    target, whose = meaning
    if target.startswith("--"):
        return f"'{name}' ({whose}) is {target} on dtrain's command line"
    return f"'{name}' ({whose}) is {target} in dtrain"
