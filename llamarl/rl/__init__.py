"""RL on top of the runtime and the run: the RL configuration (``config.py``), its checks
(``config_checks.py``) and what it implies for a run (``run_plan.py``); the standard pipeline and its
one entry point ``run_rl`` (``standard_pipeline.py``), the task a recipe runs (``task.py``), the
arithmetic and dataset recipes' shared pieces (``arithmetic_task.py``, ``dataset_recipes.py``) and
the reference-policy stage (``reference_stage.py``)."""
