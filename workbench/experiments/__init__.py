"""End-to-end runs the notebooks call: train and reopen runs (`runs`), law tables, retrofit experiments.

Everything public is re-exported here, so `from workbench.experiments import train_run, load_run`
keeps working whichever module holds the code.
"""

from .explorer import find_quickstart_checkpoint, open_model, tiny_model
from .lost_gradient import check_lost_gradient_notebook, finetune_config, finetune_lost_gradient
from .runs import (TASK_DEPTHS, Run, check_train_notebook, check_train_run, demo_trainer, law_table, load_run, passed,
                   mixed_corpus, sweep_table, task_results, train_notebook_args, train_run)

__all__ = ["TASK_DEPTHS", "Run", "check_train_notebook", "check_train_run", "demo_trainer", "law_table", "load_run",
           "mixed_corpus", "passed", "sweep_table", "task_results", "train_notebook_args", "train_run",
           "find_quickstart_checkpoint",
           "open_model", "tiny_model", "check_lost_gradient_notebook", "finetune_config",
           "finetune_lost_gradient"]
