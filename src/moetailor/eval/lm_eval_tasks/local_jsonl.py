"""lm-evaluation-harness ``custom_dataset`` loader: a JSONL file as the task's test split, found
next to the task's YAML (or at an absolute path), read without the Hugging Face hub or its cache.

In a task YAML::

    custom_dataset: !function local_jsonl.load
    dataset_kwargs:
      data_files: my_task.jsonl
"""
from __future__ import annotations

import json
from pathlib import Path


def load(data_files: str, **_):
    import datasets

    path = Path(data_files)
    if not path.is_absolute():
        path = Path(__file__).resolve().parent / path
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
