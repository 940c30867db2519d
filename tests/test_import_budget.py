"""What a process imports is what it waits for: `dtrain config` and `--help` answer without torch, and a
quick-start run loads none of the heavy modules it does not use (measured: scikit-learn ~1.5 s,
transformers more). dtrain's own modules leave torch.distributed.tensor (~0.7 s) to the runs that use
it; torch's optimizers import it with torch._dynamo at their first step, so that is checked on import.
`dtrain.checkpoint` imports no torch.distributed module beyond torch's own (its Checkpointer does)."""

import json
import sys

from helpers import ok, run

# One process, in order: the commands that must not import torch, then a 1-step run of the quick start
# (one process, so in this process; no end checkpoint: torch.distributed.checkpoint imports DTensor).
PROBE = """
import json, sys
from dtrain.cli import main
seen = {}
assert main(["--help"]) == 0
assert main(["config", "examples/digits_mlp.toml", "training.epochs=3"]) == 0
seen["torch_before_run"] = "torch" in sys.modules
import torch
plain = {m for m in sys.modules if m.startswith("torch.distributed")}  # what torch itself loads
import dtrain.checkpoint  # the package only names what its modules define
seen["checkpoint_adds"] = sorted(m for m in sys.modules if m.startswith("torch.distributed") and m not in plain)
import dtrain.worker, dtrain.train.trainer  # what a worker imports before it trains
seen["dtensor_on_import"] = "torch.distributed.tensor" in sys.modules
assert main(["run", "examples/digits_mlp.toml", "--nproc", "1", "training.max_steps=1",
             "checkpoint.at_end=false", "run.dir=" + sys.argv[1]]) == 0
seen["after_run"] = sorted(m for m in HEAVY if m in sys.modules)
seen["torch_after_run"] = "torch" in sys.modules
print("PROBE " + json.dumps(seen))
"""
HEAVY = ["sklearn", "transformers", "tokenizers", "mlflow", "wandb", "datasets"]


def test_the_quick_start_imports_no_torch_to_answer_and_no_heavy_module_it_does_not_use(tmp_path):
    result = ok(run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}", str(tmp_path / "run")]))
    seen = json.loads(result.stdout.split("PROBE ", 1)[1])
    expected = {"torch_before_run": False, "checkpoint_adds": [], "dtensor_on_import": False, "after_run": []}
    assert seen == {**expected, "torch_after_run": True}, seen
    assert (tmp_path / "run" / "model.safetensors").is_file()  # the run really ran
