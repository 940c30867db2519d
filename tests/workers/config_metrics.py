"""`training.eval_metrics = "config_metrics:macro_f1"`: a whole-split metric named in a config, as a
config-described run (`dtrain run CONFIG`, `dtrain eval RUN_DIR`) takes one."""

from sklearn.metrics import f1_score

import dtrain


@dtrain.whole_split
def macro_f1(predictions, targets):
    return {"f1": f1_score(targets.numpy(), predictions.argmax(1).numpy(), average="macro")}
