"""The RL configuration: ``RLConfig``, everything a recipe needs, one ``--section.field`` group on the
CLI per section. Parsed by tyro at a recipe's entry point only.

Each section is defined beside what it configures, and this module only composes them and checks
what ties two sections together: the model and LoRA (``llamarl/models/config.py``), the executors
(``llamarl/executors/config.py``: generator, reward, trainer), the algorithm
(``llamarl/algorithms/config.py``), the weight channel (``llamarl/channels/config.py``), the run,
checkpoints and exports (``llamarl/run/config.py``), the environment
(``llamarl/environments/config.py``). Every field has a docstring (tyro shows it in ``--help``);
every config checks itself in ``__post_init__`` and raises ``ValueError`` with one line naming the
flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamarl.algorithms.config import AlgoConfig
from llamarl.channels.config import WeightsConfig
from llamarl.environments.config import EnvConfig
from llamarl.executors.config import GeneratorConfig, RewardConfig, TrainerConfig
from llamarl.models.config import ModelConfig
from llamarl.run.config import CheckpointConfig, ExportConfig, RunConfig
from llamarl.runtime.errors import check_flag


@dataclass
class RLConfig:
    """Everything a recipe needs; each section is a ``--section.field`` group on the CLI."""

    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        # The behaviour log-probs are those of the truncated, renormalised distribution, while the
        # trainer's are of the full one: every ratio would be biased below 1, and a sampled token
        # can fall outside the trainer's own nucleus (log-prob -inf). Refused until the trainer
        # reproduces the truncation.
        check_flag(self.generator.top_p == 1.0 and self.generator.top_k == 0,
                   f"--generator.top-p {self.generator.top_p} / --generator.top-k {self.generator.top_k}: training "
                   "needs the untruncated distribution (top-p 1, top-k 0); the trainer cannot reproduce the filter")
        if self.algo.loss_agg_length is None:  # Dr. GRPO's constant: the longest a completion can be
            self.algo.loss_agg_length = self.generator.max_new_tokens
        if self.reward.max_len is None:  # the overlong shaping's limit
            self.reward.max_len = self.generator.max_new_tokens
        check_flag(self.reward.overlong_buffer <= self.reward.max_len,
                   f"--reward.overlong-buffer {self.reward.overlong_buffer} exceeds the completion limit "
                   f"{self.reward.max_len} (--generator.max-new-tokens)")
        check_flag(self.checkpoint.resume != "latest" or self.run.output_dir is not None,
                   "--checkpoint.resume latest needs --run.output-dir (the run whose checkpoints to continue)")
