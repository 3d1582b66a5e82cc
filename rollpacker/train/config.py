"""Trainer settings (no torch import here: configs parse before heavy imports).

Stream trainer (``StreamConfig``, :mod:`rollpacker.train.stream`): with ``trigger`` 0 the trigger is
adaptive: at each 5% milestone of completed prompts from 20% to 50%, rollout scales down if the
remaining requests' projected KV peak fits the kept replicas (``criterion`` kv, the paper's); with
``criterion`` throughput it must also pay: the rollout time the scale-down adds, projected from the
engine step and migration times measured during the run, must be less than the training the freed
ranks take off the step's end. A nonzero ``trigger`` scales down unconditionally at that completed
fraction (the paper's Table 3 baselines). ``fetch_cap`` 0: the freed ranks fetch every group as it
completes (asynchronous fetching); else they fetch once, at the scale-down, the groups completed by
then, at most this fraction of the round's (Table 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollpacker.choices import check_choices, refuse_unused
from rollpacker.model.config import MemoryConfig


@dataclass(kw_only=True)
class TeacherConfig:
    """On-policy distillation: a frozen teacher scores the student's sampled tokens (docs/algorithms.md)."""

    path: str = ""
    """The teacher's Hugging Face model directory (same tokenizer as model.path); empty = no distillation."""
    coef: float = 1.0
    """Weight of the teacher's per-token reverse KL (log p_student - log p_teacher of each sampled token)."""
    in_loss: bool = False
    """Put coef x KL in the loss (k2, whose gradient is the reverse KL's) instead of each token's reward."""
    task_weight: float = 1.0
    """Weight of the task reward beside the teacher's signal (0: distillation alone; rewards are still logged)."""

    def __post_init__(self) -> None:
        for name in ("coef", "task_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.teacher.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def in_reward(self) -> bool:
        """The teacher's KL enters each token's reward (through returns-to-go)."""
        return bool(self.path) and not self.in_loss


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's value model, with train.advantage gae: a decoder with a one-output head (zero at the start, or a
    reward model's score head), trained beside the policy by its own AdamW (docs/algorithms.md)."""

    path: str = ""
    """Its initial weights' Hugging Face model directory (same tokenizer as model.path); empty = model.path. A
    reward model's (one label) keeps its score head: the critic starts as the reward model."""
    lr: float = 0.0
    """Its peak AdamW learning rate, on train.lr's schedule (verl's critic.optim.lr); 0 = train.lr."""
    value_clip: float = 0.5
    """The value loss is the larger of the plain and the clipped one, the values clipped to within this of
    the step's first (verl's cliprange_value); 0 = no clip."""
    warmup_steps: int = 0
    """The run's first this many steps train the critic alone: the policy's weights and its LR schedule wait
    (verl's trainer.critic_warmup)."""

    def __post_init__(self) -> None:
        for name in ("lr", "value_clip", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.critic.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(kw_only=True)
class TrainConfig(MemoryConfig):
    """The trainer's settings; its memory settings (:class:`~rollpacker.model.config.MemoryConfig`) are the model's."""

    skip: bool = False
    """Roll out and score only: no optimizer step, no weight push (rollout measured alone)."""
    lr: float = 2e-4
    """Peak AdamW learning rate."""
    warmup_steps: int = 10
    """Linear warm-up from 0 to lr over this many RL steps that updated the policy."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """After the warm-up: constant lr, or cosine decay to min_lr_ratio x lr at the run's last step (num_steps)."""
    min_lr_ratio: float = 0.1
    """cosine: the lr at the last step, as a fraction of lr."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW weight decay, on every parameter, norms and biases too (as verl's; TRL's Trainer exempts those)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is still logged)."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch per rank (a longer sample goes alone)."""
    advantage: Literal["grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae",
                       "gdpo"] = "grpo"
    """Advantage estimator (rollpacker.train.advantages; docs/algorithms.md); gae trains a critic (train.critic);
    grpo_batch_std scales by the step's std (TRL's scale_rewards="batch"); gdpo normalizes each reward function
    in the group before the weighted sum (TRL's normalize_then_sum)."""
    gamma: float = 1.0
    """gae: the discount per token (verl's algorithm.gamma)."""
    lam: float = 1.0
    """gae: lambda, the bias-variance trade of the advantage (verl's algorithm.lam)."""
    loss: Literal["ppo", "gspo", "cispo", "sapo"] = "ppo"
    """Policy loss: ppo (token ratio clip), gspo (sequence ratio), cispo (clipped IS weight), sapo (a soft gate on the
    ratio in place of the clip; train.tau_pos, train.tau_neg)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean")
    """How token losses become the step's loss; always over the step's global counts (docs/algorithms.md)."""
    clip_low: float = 0.2
    """Ratio clip below 1 (1 - clip_low); cispo: its IS weight's lower bound."""
    clip_high: float = 0.28
    """Ratio clip above 1 (1 + clip_high), DAPO's clip-higher; cispo: its IS weight's upper bound."""
    dual_clip: float = 0.0
    """ppo: a negative-advantage token's loss is at most dual_clip x |A| (dual-clip PPO; > 1, 0 = off)."""
    tau_pos: float = 1.0
    """sapo: the gate's temperature on a positive-advantage token (larger: its gradient fades faster off r = 1)."""
    tau_neg: float = 1.05
    """sapo: the gate's temperature on a negative-advantage token (the paper's 1.05 > tau_pos: fades faster)."""
    mini_batches: int = 1
    """Optimizer steps per pass over the RL step's batch, each on a split of its groups."""
    epochs: int = 1
    """Passes over the batch's mini-batches per RL step (old log-probs frozen before the first)."""
    overlong_buffer: int = 0
    """DAPO's overlong punishment: its buffer, the last this many tokens of the budget (rollout.max_new_tokens, or
    an episode's env.max_tokens where its env.max_turns turns can reach it; 0 = off)."""
    overlong_penalty: float = 1.0
    """The punishment at the budget, rising linearly from 0 over the buffer."""
    mask_truncated: bool = False
    """Responses cut by a limit contribute no loss (DAPO's overlong filtering; verifiers' is_truncated): by
    rollout.max_new_tokens or an episode's token limits, and episodes ended by env.max_turns or by their
    environment's truncated."""
    entropy_coef: float = 0.0
    """Entropy bonus: each token's loss gets minus this times its entropy (0 = off; train/entropy is logged anyway)."""
    top_entropy_quantile: float = 1.0
    """The policy term trains only the step's tokens in this top share by entropy (before the step), as TRL's
    top_entropy_quantile ("Beyond the 80/20 rule": 0.2); 1 = every token."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen initial policy; 0 keeps no reference model."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """KL estimator per token (Schulman's k1, k2, k3; low_var_kl: k3 clamped)."""
    kl_in_reward: bool = False
    """Put -kl_coef x KL in each token's reward (REINFORCE++) instead of in the loss."""
    kl_target: float = 0.0
    """Adaptive KL (Ziegler et al.; verl's kl_ctrl adaptive): kl_coef is the start, steered toward this train/kl."""
    kl_horizon: int = 10000
    """Adaptive KL: responses over which the coefficient moves by up to 20% of its error (verl's horizon)."""
    ref_sync_steps: int = 0
    """Every this many steps the KL reference moves to ref_mixup_alpha x policy + (1 - alpha) x itself (TRL's
    sync_ref_model, TR-DPO); 0 = it stays the initial policy."""
    ref_mixup_alpha: float = 0.6
    """ref_sync_steps: the policy's share of the new reference (1 = a copy of the policy)."""
    rollout_correction: Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask"] = "none"
    """Weights for the gap between the engine's log-probs and the trainer's (mismatch, staleness)."""
    rollout_is_low: float = 0.5
    """token_mask, seq_mask: ratios below this contribute nothing."""
    rollout_is_high: float = 2.0
    """token_tis, seq_tis: weights truncated at this; token_mask, seq_mask: ratios above it contribute nothing."""
    train_shard_size: int = 0
    """Ranks that FSDP2 shards one training replica over (HSDP: replicas = world / this); 0 = world."""
    logprobs_impl: Literal["auto", "triton", "torch"] = "auto"
    """Token log-probs: triton (fused, vocab-tiled kernel), torch (chunked over tokens), auto (triton on CUDA)."""
    max_skipped_steps: int = 3
    """Stop the run after this many consecutive steps skipped for a non-finite loss or gradient (0 = never stop)."""
    reduce_every_micro_batch: bool = False
    """Reduce-scatter gradients after every micro-batch: kept sharded (4/N bytes a parameter, not 4), more traffic."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)

    def _refuse_unused(self) -> None:
        """A setting given away from its default where nothing reads it is an error: a clip_ratio_c, a lam or a
        critic's lr ported from verl under another loss or advantage did nothing, unsaid."""
        gae, sapo, teacher, lora = self.advantage == "gae", self.loss == "sapo", bool(self.teacher.path), self.lora.rank
        masks = self.rollout_correction in ("token_mask", "seq_mask")
        refuse_unused((
            (self, "train.dual_clip", self.loss == "ppo", "train.loss ppo"),
            (self, "train.clip_low", not sapo, "train.loss ppo, gspo or cispo"),
            (self, "train.clip_high", not sapo, "train.loss ppo, gspo or cispo"),
            (self, "train.tau_pos", sapo, "train.loss sapo"), (self, "train.tau_neg", sapo, "train.loss sapo"),
            (self, "train.gamma", gae, "train.advantage gae"), (self, "train.lam", gae, "train.advantage gae"),
            *((self.critic, f"train.critic.{name}", gae, "train.advantage gae")
              for name in ("lr", "value_clip", "warmup_steps")),
            *((self.teacher, f"train.teacher.{name}", teacher, "train.teacher.path")
              for name in ("coef", "in_loss", "task_weight")),
            (self, "train.kl_estimator", self.kl_coef > 0, "train.kl_coef > 0"),
            (self, "train.kl_horizon", self.kl_target > 0, "train.kl_target > 0"),
            (self, "train.ref_mixup_alpha", self.ref_sync_steps > 0, "train.ref_sync_steps > 0"),
            (self, "train.overlong_penalty", self.overlong_buffer > 0, "train.overlong_buffer > 0"),
            (self, "train.min_lr_ratio", self.lr_schedule == "cosine", "train.lr_schedule cosine"),
            (self, "train.rollout_is_low", masks, "train.rollout_correction token_mask or seq_mask"),
            (self, "train.rollout_is_high", self.rollout_correction != "none", "a train.rollout_correction"),
            *((self.lora, f"train.lora.{name}", lora, "train.lora.rank > 0")
              for name in ("alpha", "target_modules", "export_merged")),
        ))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self, "train")
        if not 0 <= self.min_lr_ratio <= 1 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] and train.betas={self.betas} "
                             "in [0, 1)")
        for name in ("lr", "micro_batch_tokens", "adam_eps", "mini_batches", "epochs", "tau_pos", "tau_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "clip_low", "clip_high", "kl_coef",
                     "train_shard_size", "max_skipped_steps", "overlong_buffer", "overlong_penalty", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.clip_low > 1:
            raise ValueError(f"train.clip_low must be in [0, 1] (the lower bound is 1 - clip_low), got {self.clip_low}")
        if self.dual_clip and self.dual_clip <= 1:
            raise ValueError(f"train.dual_clip must be > 1 (or 0: off), got {self.dual_clip}")
        if not 0 <= self.rollout_is_low <= 1 <= self.rollout_is_high:
            raise ValueError(f"train.rollout_is_low={self.rollout_is_low} and train.rollout_is_high="
                             f"{self.rollout_is_high} must satisfy 0 <= low <= 1 <= high")
        if self.kl_in_reward and not self.kl_coef:
            raise ValueError("train.kl_in_reward with train.kl_coef=0: there is no KL to put in the reward; "
                             "set train.kl_coef > 0")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(f"train.top_entropy_quantile must be in [0, 1] (1 = every token), got "
                             f"{self.top_entropy_quantile}")
        if self.ref_sync_steps < 0 or not 0 < self.ref_mixup_alpha <= 1:
            raise ValueError(f"train.ref_sync_steps={self.ref_sync_steps} must be >= 0 and train.ref_mixup_alpha="
                             f"{self.ref_mixup_alpha} in (0, 1]")
        if self.ref_sync_steps and (not self.kl_coef or self.lora.rank or self.offload):
            raise ValueError("train.ref_sync_steps moves the KL reference, which needs train.kl_coef > 0 and is "
                             "sharded like the policy: not LoRA's (the base with the adapters off; TRL refuses it "
                             "with PEFT too) nor train.offload's (whole in host memory)")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"train.gamma={self.gamma} and train.lam={self.lam} must be in [0, 1]")
        if self.critic.path and self.advantage != "gae":
            raise ValueError(f"train.critic.path with train.advantage={self.advantage!r}: only gae trains a critic; "
                             "set train.advantage gae, or drop train.critic.path")
        self._refuse_unused()
        if self.kl_target < 0 or self.kl_horizon <= 0 or (self.kl_target and not self.kl_coef):
            raise ValueError(f"train.kl_target={self.kl_target} must be >= 0 with train.kl_horizon={self.kl_horizon} "
                             f"> 0, and an adaptive KL starts from train.kl_coef={self.kl_coef}: set it > 0")

