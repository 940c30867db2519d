"""Accelerate's `examples/by_feature/checkpointing.py` (326 lines, 193 of code) and `gradient_accumulation.py`
(228 lines, 126 of code), ported to dtrain: accelerate_nlp_example.py's recipe with their flags, each one
dtrain config key. This port is 45 lines (17 of code) on top of accelerate_nlp_example.py.

    dtrain launch --nproc 2 examples/accelerate_by_feature.py --checkpointing_steps 100 \\
        --gradient_accumulation_steps 2 [--model M] [--data D] [section.key=value ...]
    dtrain launch --nproc 2 examples/accelerate_by_feature.py \\
        --resume_from_checkpoint runs/accelerate_nlp/checkpoints/step-100 --run-dir runs/accelerate_nlp_more

| their flag                        | dtrain                                                                   |
| --------------------------------- | ------------------------------------------------------------------------ |
| `--checkpointing_steps N`         | `checkpoint.every_steps=N` (and one at the end; `checkpoint.keep` newest) |
| `--checkpointing_steps epoch`     | `checkpoint.every_epochs=1`                                              |
| `--output_dir DIR`                | `--run-dir DIR` (checkpoints under DIR/checkpoints/step-N)               |
| `--resume_from_checkpoint PATH`   | `checkpoint.resume_from=PATH` (`dtrain run --resume-from PATH`)          |
| `--gradient_accumulation_steps K` | `training.grad_accum_steps=K`                                            |

What their scripts do by hand and dtrain does itself: `save_state` / `load_state` of the model, optimizer,
schedule, RNG states and the data position; working out the epoch and the batches to skip from a folder's
name (`skip_first_batches`), so a resume continues at the next batch, exactly, wherever it stopped
(SIGTERM too); a rerun in the same run.dir resumes from its newest checkpoint by itself.
`accelerator.accumulate(model)` is one key: the micro-batches but the last skip DDP's all-reduce, the
update equals one batch of all of them, and the schedule counts optimizer steps.
"""

import json

from accelerate_nlp_example import arguments, train  # the same script's recipe and arguments

parser = arguments()
parser.add_argument("--checkpointing_steps", help="save every N optimizer steps, or 'epoch'")
parser.add_argument("--resume_from_checkpoint", help="a step-N folder (or a run.dir: its newest) to start from")
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
args = parser.parse_args()

more = [f"training.grad_accum_steps={args.gradient_accumulation_steps}"]
if args.checkpointing_steps == "epoch":
    more.append("checkpoint.every_epochs=1")
elif args.checkpointing_steps:
    if not args.checkpointing_steps.isdigit():
        parser.error(f"--checkpointing_steps takes a number or 'epoch'; got {args.checkpointing_steps!r}")
    more.append(f"checkpoint.every_steps={int(args.checkpointing_steps)}")
if args.resume_from_checkpoint:
    more.append(f"checkpoint.resume_from={json.dumps(args.resume_from_checkpoint)}")  # a TOML string: any path
train(args, more)
