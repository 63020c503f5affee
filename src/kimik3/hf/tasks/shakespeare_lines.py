"""The example tasks' data: `k3_mc.jsonl` beside this file, found from any working folder.

lm-eval takes a task's `dataset_kwargs.data_files` relative to the working folder, so a task with a data file of
its own works only from where it was written. A `custom_dataset: !function shakespeare_lines.test_split` line
instead names this function, which lm-eval imports from beside the YAML file; it reads the JSONL next to it. Copy
the pattern for tasks of your own (`kimik3 eval --include-path DIR`).
"""

from pathlib import Path


def test_split(**_metadata):
    """{"test": the rows of k3_mc.jsonl} (lm-eval passes the task's metadata as keywords: not needed here)."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("k3_mc.jsonl"))})
