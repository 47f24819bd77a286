"""Run scripts/train.py and record, for every training batch, each sample's class folder name
and the label the model was given (``cond["y"]``), so that a test can check which label each
class trained under (a resume's --class_map).

Usage: RECORD_LABELS=OUT.jsonl python tests/label_record_train.py [train.py flags...]

One JSON line per step and rank: ``{"rank", "step", "classes": [folder name per sample],
"labels": [int per sample]}``, the folder names read from the dataset's file paths by the
loader's ``last_indices``. Nothing else about train.py changes.
"""
import json
import os

from train_driver import run_train_py  # tests/ (this script's folder)

from improved_diffusion import train_util

_OUT = os.environ["RECORD_LABELS"]
_real_run_step = train_util.TrainLoop.run_step


def _recording_run_step(self, batch, cond):
    paths = self.data.dataset.local_images
    classes = [os.path.basename(os.path.dirname(str(paths[int(i)])))
               for i in self.data.last_indices]
    with open(_OUT, "a") as f:
        f.write(json.dumps({"rank": self.rank, "step": self.step + 1, "classes": classes,
                            "labels": [int(y) for y in cond["y"]]}) + "\n")
    return _real_run_step(self, batch, cond)


train_util.TrainLoop.run_step = _recording_run_step

if __name__ == "__main__":
    run_train_py()
