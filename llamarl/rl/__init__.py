"""RL on top of the runtime: the task a recipe runs (``task.py``), the arithmetic and dataset recipes'
shared pieces (``arithmetic_task.py``, ``dataset_recipes.py``) and the reference-policy stage
(``reference_stage.py``). (The RL configs, checks and standard pipeline join them here.)"""
