"""Rewards: rule-based functions ``(response, answer) -> float`` looked up by name, the code
sandbox, and the pool of worker processes that scores samples asynchronously."""

from rollpacker.reward.config import RewardConfig
from rollpacker.reward.rules import REWARDS, RewardError, get_reward, math_reward, toy_reward
from rollpacker.reward.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from rollpacker.reward.workers import RewardPool, Scored

__all__ = [
    "REWARDS", "RewardConfig", "RewardError", "RewardPool", "Sandbox", "SandboxConfig", "SandboxUnavailable",
    "Scored", "get_reward", "math_reward", "toy_reward",
]
