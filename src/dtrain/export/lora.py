"""A LoRA run's export (`dtrain export RUN_DIR --format hf`, model.json holding "lora"):

    default     a PEFT adapter folder — adapter_config.json (peft's LoraConfig, the base named in
                base_model_name_or_path) and adapter_model.safetensors (the adapters under the names
                PeftModel.save_pretrained writes) — that `peft.PeftModel.from_pretrained(base, DIR)` loads
    --merged    the base with the adapters merged into it, as the run's Hugging Face folder (export/hf.py
                writes it as it writes any run's): `from_pretrained` loads it with the trained model's logits

The adapters come from the run's final weights or a checkpoint (what the run saved: only they train); the
base, for --merged, from the file its run named (model.init_from, an hf: folder), read again here. The
merged model is built whole in this one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dtrain.errors import DtrainError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def write_adapter(folder: Path, lora: dict[str, Any], adapters: dict[str, torch.Tensor]) -> None:
    """The PEFT adapter folder's two files, into `folder` (export/hf.py stages it)."""
    from safetensors.torch import save_file

    from dtrain import rundir
    from dtrain.models import lora as lora_models

    base = lora["weights"][1] if lora.get("weights") else lora["base"]  # a path from_pretrained could read
    config = lora_models.peft_config(lora["settings"], base)
    config.save_pretrained(str(folder))
    named = {name: tensor.contiguous() for name, tensor in lora_models.as_peft_names(adapters).items()}
    save_file(named, str(folder / ADAPTER_WEIGHTS), metadata=dict(rundir.WEIGHTS_MARK))
    said = json.loads((folder / ADAPTER_CONFIG).read_text())
    if not said.get("target_modules"):
        raise DtrainError(f"peft wrote {folder / ADAPTER_CONFIG} without target_modules; the export is not loadable")


def merged_state(model: dict[str, Any], adapters: dict[str, torch.Tensor], run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's base with `adapters` merged in, as a plain state dict under the base's own names."""
    from dtrain.checkpoint import init_from
    from dtrain.models import lora as lora_models

    lora = model["lora"]
    if not lora.get("weights"):
        raise DtrainError(
            f"{run_dir} trained adapters on a base no file holds ({lora['base']}): --merged needs the base's "
            f"weights; export the adapter folder (without --merged) and load it on your base with "
            f"peft.PeftModel.from_pretrained(base, DIR)"
        )
    key, path = lora["weights"]
    module = _base_model(model)
    init_from.load_into(module, init_from.resolve(key, path), is_main=True)
    lora_models.inject(module, lora_models.Lora(lora["settings"], lora["base"]))
    missing = sorted(set(lora_models.adapter_state(module.state_dict())) - set(adapters))
    if missing:
        raise DtrainError(f"{run_dir}'s weights hold no '{missing[0]}' for its adapters: it is not what the run saved")
    module.load_state_dict(adapters, strict=False)
    return {name: tensor.detach() for name, tensor in lora_models.merge(module).state_dict().items()}


def _base_model(model: dict[str, Any]) -> torch.nn.Module:
    """The base model as model.json says it, built on the CPU in fp32 (its weights read next)."""
    if model["kind"] == "gpt":
        from dtrain.models.gpt import GPT

        options = dict(model["options"])
        return GPT(options.pop("vocab_size"), options.pop("block_size"), **options)
    import transformers

    config = dict(model["config"])
    built = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    cls = getattr(transformers, model["architecture"], None)
    if cls is None:
        raise DtrainError(f"transformers {transformers.__version__} has no {model['architecture']}: cannot merge")
    return cls._from_config(built, dtype=torch.float32)
