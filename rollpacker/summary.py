"""What rank 0 says before the first step: what the run is about to do, and one prompt as the engine gets it.

Checking the chat template is the first thing one does with a new model; the summary shows its
effect on a real row (the rendered text, special tokens and all), beside the data, the model, the
reward functions, the ranks, the policy and the steps.
"""

from __future__ import annotations

import collections
import textwrap

SHOWN_CHARS = 1200
"""Most characters of the rendered prompt shown."""


def start_summary(job) -> str:
    """The summary of ``job`` (rank 0's: it holds the controller)."""
    cfg, ctl, meshes = job.config, job.controller, job.meshes
    r = cfg.rollout
    resumed = f", resumed from {cfg.resume}" if cfg.resume else ""
    every = f"every {cfg.checkpoint_every} steps and " if cfg.checkpoint_every else ""
    planned = planned_steps(job)
    epochs = (f" (num_epochs {cfg.num_epochs} ends the data first; num_steps {cfg.num_steps})"
              if planned < cfg.num_steps else "")
    lines = [
        f"rollpacker: {meshes.world_size} rank(s) on {meshes.device.type}, schedule:{cfg.policy}, steps "
        f"{job.start_step} to {planned - 1}{epochs}, each {r.num_prompts} prompts x {r.group_size} "
        f"responses{resumed}",
        f"  data: {_rows(ctl.rows, cfg.data.path)}{_toy_under(cfg)}"
        + (f"; held out: {_rows(ctl.eval_rows, cfg.data.eval_path or _slice(cfg.data))}" if ctl.eval_rows else ""),
        f"  model: {cfg.model.path or 'the shipped toy model'} ({job.model_dir}), engine {cfg.engine.kind}; "
        f"{_template(ctl.tokenizer, cfg)}",
        f"  rewards: {_rewards(ctl)}; a failing call: "
        f"{cfg.reward.on_error}" + (f", stop past {cfg.reward.max_error_frac:.0%} of a step's responses"
                                    if cfg.reward.on_error == "skip" and cfg.reward.max_error_frac < 1 else ""),
        *([f"  episodes: {_episodes(cfg.env)}"] if cfg.env.enabled else []),
        f"  training: {_training(cfg)}",
        f"  checkpoints: {every}at the end, in {cfg.run_dir}/checkpoints, "
        f"{f'the newest {cfg.checkpoint.keep} kept' if cfg.checkpoint.keep else 'all kept (--checkpoint.keep)'}; "
        f"metrics: {cfg.run_dir}/metrics.jsonl",
    ]
    row = ctl.rows[0]
    ids = _prompt_ids(ctl, row)
    from rollpacker.data.chat import prompt_text

    text = prompt_text(ctl.tokenizer, ids)
    shown = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + " [...]"
    where = ("before the environment's reset, which may change it and add its tools; every sample file has the "
             "episode's as prompt_text" if ctl.config.env.factory else "every sample file has it as prompt_text")
    lines.append(f"  row {row['id']!r} as the engine gets it ({len(ids)} tokens; {where}):")
    lines.append(textwrap.indent(shown, "    | ", predicate=lambda _: True))
    return "\n".join(lines)


def planned_steps(job) -> int:
    """The steps ``job`` runs: num_steps, or fewer where num_epochs passes over the data end first (the rows left to
    draw, num_prompts a step; about that many where its rounds refill after filtering or hold prompts back). A policy
    of the user's without a sampler runs num_steps."""
    cfg, policy = job.config, job.controller.policy
    sampler, ledger = getattr(policy, "sampler", None), getattr(policy, "ledger", None)
    left = sampler.remaining(cfg.num_epochs) if sampler is not None else None
    if left is None:
        return cfg.num_steps
    left += len(ledger.queue) if ledger is not None else 0  # drawn, held back (tail's long queue): trained yet
    return min(cfg.num_steps, job.start_step + -(-left // cfg.rollout.num_prompts))


def _prompt_ids(ctl, row: dict) -> list[int]:
    """``row``'s prompt as the engine gets it; with ``env.tools``, as an episode's (their schemas rendered by the
    template). With an environment, its reset may give another prompt and tools of its own: the row's is shown."""
    env = ctl.config.env
    if env.tools:
        from rollpacker.env.tools import load_tools, schemas

        return ctl.envs.encode(row["prompt"], schemas(load_tools(env.tools)))
    return ctl.encode_prompt(row)


def _rewards(ctl) -> str:
    """The reward functions and weights, the environment's rewards with episodes, and what counts as correct."""
    parts = [f"{f.name} x{f.weight:g}" for f in ctl.rewards.functions]
    if ctl.config.env.factory:  # tools alone reward nothing themselves
        parts.append("the environment's")
    return f"{', '.join(parts)} (correct: {ctl.config.reward.correct or 'the reward'} >= 1)"


TOY_LR = 1e-4
"""A peak learning rate this high suits the shipped toy models (trained from scratch), not a pretrained LLM."""


def _training(cfg) -> str:
    """The algorithm and the learning rate's schedule; a toy-sized learning rate on another model, flagged."""
    t = cfg.train
    schedule = f"cosine to {t.min_lr_ratio:g}x" if t.lr_schedule == "cosine" else "constant"
    flag = (" (a toy model's: RL on a pretrained model takes about 1e-6, TRL's and verl's default; set --train.lr)"
            if t.lr >= TOY_LR and not (cfg.model.shipped or t.lora.rank) else "")  # LoRA takes ~1e-4 and more
    return (f"{t.advantage} advantages, {t.loss} loss ({t.aggregation}), kl {t.kl_coef:g}; lr {t.lr:g}{flag}, "
            f"warm-up {t.warmup_steps} steps, then {schedule}")


def _episodes(env) -> str:
    """The environment, its tools and an episode's limits."""
    tools = f" with tools {', '.join(env.tools)}" if env.tools else ""
    return (f"{env.factory or 'tools alone'}{tools}, at most {env.max_turns} turns, {env.num_workers} workers, "
            f"{env.timeout:g} s per call, on error {env.on_error}")


def _rows(rows: list[dict], paths: tuple[str, ...]) -> str:
    sources = collections.Counter(row["data_source"] for row in rows if row.get("data_source") is not None)
    named = ", ".join(f"{s} {n}" for s, n in sources.most_common(5))
    more = f" and {len(sources) - 5} more sources" if len(sources) > 5 else ""
    where = ", ".join(paths) or "the toy task"
    return f"{len(rows)} rows from {where}" + (f" (sources: {named}{more})" if named else "")


def _toy_under(cfg) -> str:
    """Flags an environment of the user's on the toy task's rows (no ``data.path``): a TRL or gym environment that
    draws its own task would run after a toy arithmetic problem, silently."""
    from rollpacker.env.config import FACTORIES

    if cfg.data.path or not cfg.env.factory or cfg.env.factory in FACTORIES:
        return ""
    return (f" (no --data.path: each episode of {cfg.env.factory} gets a toy arithmetic problem as its row, and as "
            "its prompt unless its reset returns one (a TRL environment's reset text follows it); give --data.path, "
            "with rows of one empty user turn for an environment that draws its own tasks)")


def _slice(data) -> tuple[str, ...]:
    """The held-out slice of data.path an eval_split without eval_path names (none: toy problems)."""
    return tuple(f"{p} [{data.eval_split}]" for p in data.path) if data.eval_split else ()


def _template(tokenizer, cfg) -> str:
    """How prompts are rendered: through the tokenizer's chat template (for which prompts, with what), or not."""
    if not getattr(tokenizer, "chat_template", None):
        return "its tokenizer has no chat template: prompts are tokenized as they are"
    which = ("every prompt (--model.chat-template)" if cfg.model.chat_template else
             "every prompt, with the tools' schemas (--env.tools)" if cfg.env.tools else "message-list prompts")
    extra = "".join(f", {name} {value!r}" for name, value in (("system prompt", cfg.data.system_prompt),
                                                              ("template kwargs", cfg.model.chat_template_kwargs))
                    if value)
    return f"the tokenizer's chat template renders {which}{extra}"
