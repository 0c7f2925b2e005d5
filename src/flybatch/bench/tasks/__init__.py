"""The task registry: task name -> the module that defines its :class:`~.base.Task` subclass.

A task module defines a subclass of ``Task`` whose class attribute ``name`` is the task's name
(e.g. ``class ParserTask(Task): name = "parser"``). Modules are imported on first use, so a
task under construction does not break the others.
"""

from __future__ import annotations

import importlib

import torch

from flybatch.bench.tasks.base import EXTRA_MODES, FLYBATCH_MODES, MODES, StepResult, Task
from flybatch.bench.tasks_data import TaskData

MODULES = {
    "bilstm-synthetic": "taggers",
    "bilstm": "taggers",
    "bilstm-char": "taggers",
    "treelstm": "treelstm",
    "parser": "parser",
}
TASKS = tuple(MODULES)

__all__ = ["EXTRA_MODES", "FLYBATCH_MODES", "MODES", "StepResult", "TASKS", "Task", "create",
           "task_class"]


def task_class(name: str) -> type[Task]:
    """The Task subclass registered for ``name``."""
    if name not in MODULES:
        raise ValueError(f"unknown task {name!r}; expected one of {TASKS}")
    module = importlib.import_module(f"flybatch.bench.tasks.{MODULES[name]}")
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, Task) and obj.name == name:
            return obj
    raise LookupError(f"flybatch.bench.tasks.{MODULES[name]} defines no Task with name {name!r}")


def create(name: str, data: TaskData, device: str | torch.device = "cpu", seed: int = 0) -> Task:
    return task_class(name)(data, device, seed)
