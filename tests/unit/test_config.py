"""Presets, flags and config errors: all before torch is imported."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from rollpacker.config import CONFIGS_DIR, load_preset, parse
from rollpacker.schedule.config import check_settings, schedule_args
from rollpacker.schedule.eval import EvalConfig
from rollpacker.schedule.tail import TailConfig

PRESETS = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))


def test_presets_exist():
    assert {"toy-cpu", "qwen2.5-7b-8k", "qwen2.5-14b-16k", "qwen2.5-32b-32k"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds(name):
    config = parse(["--preset", name])  # through the real CLI, as `rollpacker.run --preset NAME` reads it
    assert config == load_preset(name)
    if name.startswith("qwen2.5"):
        assert (config.rollout.num_prompts, config.rollout.group_size) == (128, 8)
        config.check_world(config.rollout.tp * 2)


def test_one_set_of_defaults_a_bare_config_is_the_default_job():
    from rollpacker.config import Config

    assert parse([]) == load_preset("toy-cpu") == Config()


def test_flags_override_the_preset():
    config = parse(["--preset", "qwen2.5-7b-8k", "--rollout.num-prompts", "64", "--train.lr", "2e-6"])
    assert config.rollout.num_prompts == 64 and config.train.lr == 2e-6
    assert config.rollout.max_new_tokens == 8192


def test_flags_complete_a_preset_its_settings_alone_would_not_pass(tmp_path):
    """A preset is checked as a whole with the flags on top of it: one naming data.path alone was refused, before
    the flags applied, as lacking the --data.eval-path the command line gave."""
    mine = tmp_path / "mine.toml"
    mine.write_text('[data]\npath = ["x.jsonl"]\n[reward]\nfuncs = ["math"]\n')
    assert parse(["--preset", str(mine), "--data.eval-path", "held_out.jsonl"]).data.eval_path == ("held_out.jsonl",)
    assert parse(["--preset", str(mine), "--eval-every", "0"]).eval_every == 0
    with pytest.raises(SystemExit):  # alone, it still is refused
        parse(["--preset", str(mine)])


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(SystemExit):
        parse(["--rollout.group-size", "0"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlrr = 1.0\n")
    with pytest.raises(ValueError, match="bad.toml: unknown setting 'train.lrr'"):
        load_preset(str(bad))
    with pytest.raises(FileNotFoundError, match="known presets"):
        load_preset("no-such-preset")
    one = tmp_path / "one.toml"  # a list setting given one value, as a flag takes it (not its letters: 'm', ...)
    one.write_text('[reward]\nfuncs = "math"\nweights = 2\n')
    assert (load_preset(str(one)).reward.funcs, load_preset(str(one)).reward.weights) == (("math",), (2,))
    with pytest.raises(ValueError, match="rollout.tp=2 does not divide the world size 3"):
        parse(["--rollout.tp", "2"]).check_world(3)
    with pytest.raises(ValueError, match=r"rollout.num_prompts x rollout.group_size = 3 x 3"):
        parse(["--rollout.num-prompts", "3", "--rollout.group-size", "3"]).check_world(2)
    pipe = ["--schedule.pipe", "--rollout.tp", "2", "--rollout.num-prompts", "6"]  # frees ranks 4..5 of 6
    with pytest.raises(ValueError, match=r"set train.train_shard_size to 1 or 2 \(divisors of both 4 and the 6"):
        parse(pipe).check_world(6)
    parse([*pipe, "--train.train-shard-size", "2"]).check_world(6)  # as the message says
    # one_step_off on 2 ranks rolls out on 1: any number of responses splits over it
    parse(["schedule:one_step_off", "--train.rollout-correction", "token_tis", "--rollout.num-prompts", "3",
           "--rollout.group-size", "3"]).check_world(2)


def test_a_setting_that_is_not_a_finite_number_is_refused_by_name(tmp_path, capsys):
    """NaN passes every comparison's check (``lr < 0`` is false): a NaN learning rate trained NaN weights; an
    infinite reward.timeout crashed the reward pool's manager mid-run. Every float setting's NaN or infinity is
    refused, in a preset too."""
    for value in ("nan", "inf"):
        with pytest.raises(SystemExit):
            parse(["--train.lr", value])
        assert f"train.lr={value}: not a finite number" in " ".join(capsys.readouterr().err.replace("│", " ").split())
    preset = tmp_path / "p.toml"
    preset.write_text("[reward]\ntimeout = inf\n[train]\nkl_coef = nan\n")
    with pytest.raises(SystemExit):
        parse(["--preset", str(preset)])
    said = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert "reward.timeout=inf, train.kl_coef=nan: not a finite number" in said


def test_choice_fields_are_typed_and_refuse_unknown_values_by_name(capsys):
    with pytest.raises(SystemExit, match="schedule:tial: no such policy"):
        parse(["schedule:tial"])
    with pytest.raises(SystemExit):
        parse(["--train.rollout-correction", "maybe"])
    assert parse(["schedule:tail", "--stream.enabled", "--stream.criterion", "kv"]).stream.criterion == "kv"


def test_the_policy_is_a_tagged_union_of_its_own_settings(tmp_path):
    tail = parse(["--seed", "3", "schedule:tail", "--schedule.eta-prompts", "1.5", "--num-steps", "4"])
    assert (tail.policy, tail.schedule, tail.seed, tail.num_steps) == (
        "tail", TailConfig(eta_prompts=1.5, eta_responses=1.25, eta_long=1.0), 3, 4)
    assert parse(["schedule:sorted-partial", "--train.rollout-correction", "token_tis"]).policy == "sorted_partial"
    with pytest.raises(SystemExit, match=r"schedule.eta_prompts does not apply to policy sync \(it is a setting "
                                         r"of tail\)"):
        parse(["--schedule.eta-prompts", "1.5"])  # the preset's policy is sync
    preset = tmp_path / "tail.toml"
    preset.write_text('[schedule]\npolicy = "tail"\neta_responses = 2.0\n')
    assert parse(["--preset", str(preset), "--schedule.eta-prompts", "1.5"]).schedule == TailConfig(
        eta_prompts=1.5, eta_responses=2.0, eta_long=1.0)  # a --schedule flag alone applies to the preset's policy
    preset.write_text('[schedule]\npolicy = "sorted"\neta_prompts = 2.0\n')
    with pytest.raises(ValueError, match="schedule.eta_prompts does not apply to policy sorted"):
        load_preset(str(preset))
    preset.write_text('policy = "tail"\n')
    with pytest.raises(ValueError, match="tail.toml: unknown setting 'policy'"):
        load_preset(str(preset))


def test_a_presets_value_of_the_wrong_type_is_refused_and_its_name_takes_an_equals_sign(tmp_path):
    """tyro takes a preset's value as it is: a quoted "false" stayed a string (true: the run exported), 4.5 prompts
    passed every check. And --preset=NAME, the other way to write a flag, was an unknown option."""
    preset = tmp_path / "mine.toml"
    for text, said in (('[checkpoint]\nexport_hf = "false"\n', "mine.toml: checkpoint.export_hf = 'false' is a str, "
                        "and the setting takes bool (true or false, unquoted)"),
                       ("[rollout]\nnum_prompts = 4.5\n", "num_prompts = 4.5 is a float, and the setting takes int"),
                       ("[rollout]\nnum_prompts = true\n", "num_prompts = True is a bool, and the setting takes int"),
                       # a section given a value: a crash at the start (model), the defaults kept silently (train)
                       ('model = "x"\n', "mine.toml: model = 'x': model is a section of settings; write them under "
                        "[model] (e.g. model.NAME = ...)"),
                       ("train = 5\n", "mine.toml: train = 5: train is a section of settings"),
                       ('schedule = "tail"\n', "mine.toml: schedule = 'tail': schedule is a section of settings"),
                       # a list of another length or kind: an IndexError in the optimizer, after the engines started
                       ("[train]\nbetas = [0.9]\n", "mine.toml: train.betas = [0.9] holds 1 values, and the setting "
                        "takes 2"),
                       ('[rollout]\nstop_token_ids = ["a"]\n', "mine.toml: rollout.stop_token_ids = ['a']: 'a' is a "
                        "str, and the setting takes int")):
        preset.write_text(text)
        with pytest.raises(ValueError, match=re.escape(said)):
            load_preset(str(preset))
    preset.write_text("seed = 3\n[train]\nlr = 1\n[checkpoint]\nexport_hf = false\n")  # an int where a float goes
    config = parse([f"--preset={preset}"])
    assert (config.seed, config.train.lr, config.checkpoint.export_hf) == (3, 1, False)
    with pytest.raises(SystemExit, match="--preset given twice"):
        parse(["--preset", str(preset), "--preset=toy-cpu"])
    # a [schedule] setting too: `eta_prompts = "2"` gave "'<' not supported ...", naming no key
    for text, said in (('[schedule]\npolicy = "tail"\neta_prompts = "2"\n', "mine.toml: schedule.eta_prompts = '2' "
                        "is a str, and the setting takes float"),
                       ('[schedule]\nfilter_zero_variance = "false"\n', "mine.toml: schedule.filter_zero_variance = "
                        "'false' is a str, and the setting takes bool")):
        preset.write_text(text)
        with pytest.raises(ValueError, match=re.escape(said)):
            load_preset(str(preset))


def test_stream_and_planner_settings_nothing_reads_are_refused(capsys):
    """stream.* without stream training (RolloutPipe reads none), the adaptive trigger's settings under a fixed one,
    the planner's without it, engine.spec_max_tokens without speculation: each was silently unread, as train.*'s
    were."""
    for flags, said in ((["--stream.criterion", "kv"], "stream.criterion (applies with stream.enabled and "
                          "stream.trigger 0: the adaptive trigger)"),
                        (["--schedule.pipe", "--stream.fetch-cap", "0.5"], "stream.fetch_cap (applies with "
                         "stream.enabled)"),
                        (["--stream.enabled", "--stream.trigger", "0.3", "--stream.length-quantile", "0.5"],
                         "stream.length_quantile (applies with stream.enabled and stream.trigger 0"),
                        (["--plan.initial-tp", "2", "--plan.no-per-kind"], "plan.initial_tp (applies with "
                         "plan.enabled), plan.per_kind (applies with plan.enabled): given, but nothing reads it"),
                        (["--engine.spec-max-tokens", "4"], "engine.spec_max_tokens (applies with "
                         "engine.speculative on or auto)"),
                        (["--data.split", "train[:10]", "--data.eval-split", "train[:3]"], "data.split (applies with "
                         "data.path: the toy task has no splits), data.eval_split (applies with data.path"),
                        (["schedule:sync", "--schedule.refill", "--schedule.filter-zero-variance",
                          "--schedule.max-gen-batches", "-1"], "schedule.max_gen_batches=-1: the times a round may "
                         "draw rollout.num_prompts, 0 for no limit")):
        with pytest.raises(SystemExit):
            parse(flags)
        assert said in " ".join(capsys.readouterr().err.replace("│", " ").split()), flags
    # what the profiler reads (python -m rollpacker.profile takes the run's flags), and each with what it applies
    parse(["--plan.profile-batches", "1", "4", "--plan.max-tp", "2", "--plan.profile-dir", "p"])
    parse(["--stream.enabled", "--stream.trigger", "0.3", "--stream.fetch-cap", "0.5"])
    parse(["--plan.enabled", "--plan.no-per-kind"])
    parse(["--engine.speculative", "auto", "--engine.spec-max-tokens", "4"])


def test_contradictions_the_job_met_late_are_refused_at_parse(capsys):
    """betas out of [0, 1) failed in torch's AdamW after the engines started; initial_tp > max_tp in the planner
    after profiling. A policy spelled with a dash (as schedule:NAME and --help write it) was unknown to
    --schedule.policy, and a misspelled setting listed the policy's class constants among its settings."""
    for flags, said in ((["--train.betas", "0.9", "1.5"], "train.betas=(0.9, 1.5) in [0, 1)"),
                        (["--plan.enabled", "--plan.initial-tp", "8", "--plan.max-tp", "2"], "plan.initial_tp=8 and")):
        with pytest.raises(SystemExit):
            parse(flags)
        assert said in capsys.readouterr().err
    assert parse(["--schedule.policy", "one-step-off", "--train.rollout-correction", "token_tis"]).schedule.name == (
        "one_step_off")
    with pytest.raises(ValueError) as e:
        check_settings("tail", ["eta_promts"])
    assert "carries_responses" not in str(e.value) and "eta_prompts" in str(e.value)


def test_a_policy_chosen_over_the_presets_keeps_the_presets_settings_it_has_too(tmp_path):
    """A preset's [schedule] of one policy under schedule:NAME of another: its dynamic sampling went unsaid (the
    new policy's defaults in its place); its own policy's settings stay behind, as does a bound on refills where
    none happen."""
    preset = tmp_path / "mine.toml"
    preset.write_text('[schedule]\npolicy = "tail"\nfilter_zero_variance = true\nmax_gen_batches = 4\n'
                      "eta_long = 2\n")
    tail = parse(["--preset", str(preset)]).schedule
    assert (tail.filter_zero_variance, tail.max_gen_batches, tail.eta_long) == (True, 4, 2)
    for policy in ("sync", "sorted"):
        config = parse(["--preset", str(preset), f"schedule:{policy}"])
        assert (config.schedule.filter_zero_variance, config.schedule.max_gen_batches) == (True, 10), policy
    assert not parse(["--preset", str(preset), "schedule:sync", "--schedule.no-filter-zero-variance"]
                     ).schedule.filter_zero_variance
    # a bound on refills kept where the flags make the rounds refill, dropped unsaid where they stop refilling (it
    # was lost under --schedule.refill; --schedule.no-filter-zero-variance was unknown to tyro without schedule:tail,
    # and with it blamed a max_gen_batches not given)
    assert parse(["--preset", str(preset), "schedule:sync", "--schedule.refill"]).schedule.max_gen_batches == 4
    for flags in (["--schedule.no-filter-zero-variance"], ["schedule:tail", "--schedule.no-filter-zero-variance"]):
        assert parse(["--preset", str(preset), *flags]).schedule.max_gen_batches == 10
    assert schedule_args(["--help"], "tail") == ["--help"]  # the run's help, listing the policies: no subcommand
    assert parse(["--preset", str(preset), "--schedule.max-gen-batches", "6"]).schedule.max_gen_batches == 6


def test_every_registered_algorithm_piece_is_a_cli_choice():
    """The registries and the config's Literals name the same things, and each name parses from the
    command line (a new estimator or loss is its function, its registry line and its Literal entry)."""
    from typing import get_args, get_type_hints

    from rollpacker.train.advantages import ADVANTAGES
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.losses import AGGREGATIONS, CORRECTIONS, KL_ESTIMATORS, LOSSES

    hints = get_type_hints(TrainConfig)
    registries = {"advantage": ADVANTAGES, "loss": LOSSES, "aggregation": AGGREGATIONS,
                  "kl_estimator": KL_ESTIMATORS, "rollout_correction": CORRECTIONS}
    for field, registry in registries.items():
        assert set(get_args(hints[field])) == set(registry), field
    for i in range(max(map(len, registries.values()))):  # one parse sets every field: 5 parses, not 18
        chosen = {field: list(registry)[i % len(registry)] for field, registry in registries.items()}
        flags = [arg for field, name in chosen.items() for arg in (f"--train.{field.replace('_', '-')}", name)]
        train = parse([*flags, "--train.kl-coef", "0.01"]).train  # a KL estimator applies with a KL
        assert {field: getattr(train, field) for field in chosen} == chosen
    with pytest.raises(SystemExit):
        parse(["--train.advantage", "ppo"])
    # a setting nothing reads under the others (verl's clip_ratio_c, lam, critic lr ported as they are): refused
    from rollpacker.train.config import CriticConfig, TeacherConfig

    for settings, named in ((dict(dual_clip=3.0, loss="gspo"), "train.dual_clip (applies with train.loss ppo)"),
                            (dict(lam=0.95), "train.lam (applies with train.advantage gae)"),
                            (dict(critic=CriticConfig(lr=1e-5)), "train.critic.lr (applies with train.advantage gae)"),
                            (dict(teacher=TeacherConfig(in_loss=True)), "train.teacher.in_loss (applies with "
                                                                        "train.teacher.path)"),
                            (dict(kl_estimator="k1"), "train.kl_estimator (applies with train.kl_coef > 0)"),
                            (dict(rollout_correction="token_tis", rollout_is_low=0.1), "train.rollout_is_low"),
                            (dict(loss="sapo", clip_high=0.3), "train.clip_high (applies with train.loss ppo, gspo"),
                            (dict(overlong_penalty=0.5), "train.overlong_penalty (applies with train.overlong_buffer"),
                            (dict(lr_schedule="constant", min_lr_ratio=0.0), "train.min_lr_ratio (applies with "
                                                                             "train.lr_schedule cosine)")):
        with pytest.raises(ValueError, match=re.escape(named)):
            TrainConfig(**settings)
    TrainConfig(advantage="gae", lam=0.95, critic=CriticConfig(lr=1e-5), loss="ppo", dual_clip=3.0)  # where they apply
    config = parse(["--train.mini-batches", "4", "--train.epochs", "2", "--train.kl-coef", "0.01",
                    "--train.kl-in-reward", "--train.overlong-buffer", "64", "--train.mask-truncated",
                    "--train.entropy-coef", "0.001", "--train.dual-clip", "3"])
    t = config.train
    assert (t.mini_batches, t.epochs, t.kl_in_reward, t.overlong_buffer, t.mask_truncated, t.entropy_coef,
            t.dual_clip) == (4, 2, True, 64, True, 0.001, 3.0)


@pytest.mark.parametrize("settings,message", [
    (dict(advantage="reinforce_pp"), "train.advantage='reinforce_pp'.*per-group estimator"),
    (dict(advantage="reinforce_pp_baseline"), ".*whole step's batch"),
    (dict(advantage="gae"), "train.advantage='gae'.*whole step's batch"),
    (dict(mini_batches=2), "train.mini_batches=2, train.epochs=1.*set both to 1"),
    (dict(epochs=3), "train.mini_batches=1, train.epochs=3"),
    (dict(kl_coef=0.1, kl_in_reward=True), "train.kl_in_reward.*put the KL in the loss"),
    (dict(top_entropy_quantile=0.2), "train.top_entropy_quantile=0.2.*the whole step's.*set it to 1"),
])
def test_streaming_refuses_what_a_group_cannot_finish_alone(settings, message):
    from rollpacker.config import Config
    from rollpacker.schedule.scale_down import StreamConfig
    from rollpacker.train.config import TrainConfig

    with pytest.raises(ValueError, match=f"stream.enabled with {message}"):
        Config(train=TrainConfig(**settings), stream=StreamConfig(enabled=True))
    Config(train=TrainConfig(**settings))  # fine without streaming


def test_algorithm_settings_name_the_field():
    from rollpacker.config import Config
    from rollpacker.env.config import EnvConfig
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.train.config import CriticConfig, TrainConfig

    for settings, message in ((dict(mini_batches=0), "train.mini_batches must be positive"),
                              (dict(clip_low=1.5), "train.clip_low must be in"),
                              (dict(rollout_is_low=1.5), "train.rollout_is_low=1.5"),
                              (dict(kl_in_reward=True), "train.kl_in_reward with train.kl_coef=0"),
                              (dict(kl_target=0.1), "adaptive KL starts from train.kl_coef=0.0: set it > 0"),
                              (dict(ref_sync_steps=10), "ref_sync_steps moves the KL reference, which needs"),
                              (dict(ref_sync_steps=10, kl_coef=0.1, offload=True), "nor train.offload's"),
                              (dict(ref_sync_steps=10, kl_coef=0.1, ref_mixup_alpha=0), "ref_mixup_alpha=0 in"),
                              (dict(overlong_buffer=-1), "train.overlong_buffer must be >= 0"),
                              (dict(lam=1.5), "train.gamma=1.0 and train.lam=1.5 must be in"),
                              (dict(critic=CriticConfig(path="/critic")), "only gae trains a critic")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**settings)
    with pytest.raises(ValueError, match="train.critic.value_clip must be >= 0"):
        CriticConfig(value_clip=-1)
    with pytest.raises(ValueError, match="train.mini_batches=32 exceeds rollout.num_prompts=16"):
        Config(train=TrainConfig(mini_batches=32))
    warm = TrainConfig(advantage="gae", critic=CriticConfig(warmup_steps=5))  # the policy would never train
    Config(train=warm, num_steps=6)
    with pytest.raises(ValueError, match="train.critic.warmup_steps=5 is not below num_steps=5: each step would"):
        Config(train=warm, num_steps=5)
    Config(train=TrainConfig(overlong_buffer=3), rollout=RolloutConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="train.overlong_buffer=4 is not below rollout.max_new_tokens=4"):
        Config(train=TrainConfig(overlong_buffer=4), rollout=RolloutConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="train.overlong_buffer=64 is not below env.max_tokens=48"):  # an episode's
        Config(train=TrainConfig(overlong_buffer=64), env=EnvConfig(factory="toy", max_tokens=48))
    # An episode reaches env.max_tokens only where its turns can: 2 turns of 64 tokens hold 128, not 512.
    unreachable = Config(env=EnvConfig(factory="toy", max_turns=2, max_tokens=512),
                         rollout=RolloutConfig(max_new_tokens=64))
    assert unreachable.model_budget == ("env.max_turns x rollout.max_new_tokens", 128)
    with pytest.raises(ValueError, match="overlong_buffer=200 is not below env.max_turns x rollout.max_new_tokens=128"):
        Config(env=unreachable.env, rollout=unreachable.rollout, train=TrainConfig(overlong_buffer=200))
    with_tools = Config(env=EnvConfig(tools=("python",), max_turns=2))  # an episode's turns share max_new_tokens
    assert with_tools.model_budget == ("rollout.max_new_tokens", with_tools.rollout.max_new_tokens)


def test_engine_rules_ask_the_engine_registry():
    from rollpacker.choices import choices
    from rollpacker.config import Config
    from rollpacker.plan.config import PlanConfig
    from rollpacker.rollout import ENGINES
    from rollpacker.rollout.config import EngineConfig, RolloutConfig

    assert set(choices(EngineConfig)["kind"]) == {"auto", *ENGINES}
    assert ENGINES["torch"].supports_tp_switch and ENGINES["vllm"].needs_world_groups
    Config(engine=EngineConfig(kind="auto"), plan=PlanConfig(enabled=True))  # auto picks one the planner can switch
    for kind, engine in ENGINES.items():
        if engine.supports_tp_switch:
            Config(engine=EngineConfig(kind=kind), plan=PlanConfig(enabled=True))
        else:
            with pytest.raises(ValueError, match=f"plan.enabled with engine.kind='{kind}': a TP switch"):
                Config(engine=EngineConfig(kind=kind), plan=PlanConfig(enabled=True))
    penalized = RolloutConfig(repetition_penalty=1.2)  # refused at parse where the engine cannot, auto at its start
    for kind in ("auto", *ENGINES):
        if kind == "auto" or not ENGINES[kind].no_repetition_penalty:
            Config(engine=EngineConfig(kind=kind), rollout=penalized)
        else:
            with pytest.raises(ValueError, match=f"repetition_penalty=1.2 with engine.kind='{kind}': SGLang 0.5.23.s "
                                                 "repetition penalty counts only .* or engine.kind='torch' or 'vllm'"):
                Config(engine=EngineConfig(kind=kind), rollout=penalized)
    # SGLang's sampler asserts on min-p with a request's seed: its engine died at the first step
    for kind in ("auto", *ENGINES):
        if kind == "auto" or not ENGINES[kind].no_min_p:
            Config(engine=EngineConfig(kind=kind), rollout=RolloutConfig(min_p=0.05))
        else:
            with pytest.raises(ValueError, match=f"rollout.min_p=0.05 with engine.kind='{kind}': SGLang 0.5.23.s "
                                                 "sampler asserts .*; set rollout.min_p=0, or engine.kind='torch' or "
                                                 "'vllm'"):
                Config(engine=EngineConfig(kind=kind), rollout=RolloutConfig(min_p=0.05))
    # logits over a temperature below fp32's range are infinite: NaN log-probs and the last token id, unsaid
    with pytest.raises(ValueError, match=r"temperature=1e-39 is below 0.01 \(vLLM samples .*: use 0 \(greedy\) or"):
        RolloutConfig(temperature=1e-39)
    # vLLM samples at 0.01 below it (the trainer's log-probs at 0.005); eval's was refused at the first evaluation
    with pytest.raises(ValueError, match=r"temperature=0.005 is below 0.01 .* or more"):
        RolloutConfig(temperature=0.005)
    with pytest.raises(ValueError, match=r"eval.temperature=1e-06 is below 0.01"):
        EvalConfig(temperature=1e-6)
    # SGLang cuts top-p on the whole mass, not on what top-k leaves: it sampled tokens the other engines never would
    both = RolloutConfig(top_k=3, top_p=0.4)
    for kind in ("auto", *ENGINES):
        if kind == "auto" or not ENGINES[kind].no_top_k_with_top_p:
            Config(engine=EngineConfig(kind=kind), rollout=both)
        else:
            with pytest.raises(ValueError, match=f"rollout.top_k=3 with rollout.top_p=0.4 and engine.kind='{kind}': "
                                                 "SGLang 0.5.23 cuts top-p on the whole .*; set one of them, or "
                                                 "engine.kind='torch' or 'vllm'"):
                Config(engine=EngineConfig(kind=kind), rollout=both)
            Config(engine=EngineConfig(kind=kind), rollout=RolloutConfig(top_k=3))  # either alone: as theirs
    # SGLang's ignore_eos (a replayed length) ignores stop tokens: the job died at its first request, engines started
    replayed = RolloutConfig(replay_lengths=True, stop_token_ids=(5,))
    for kind in ("auto", *ENGINES):
        if kind == "auto" or not ENGINES[kind].no_stop_ids_with_replay:
            Config(engine=EngineConfig(kind=kind), rollout=replayed)
        else:
            with pytest.raises(ValueError, match=rf"rollout.replay_lengths with rollout.stop_token_ids=\(5,\) and "
                                                 rf"engine.kind='{kind}': SGLang 0.5.23.s ignore_eos, .* ignores stop "
                                                 "token ids too; set one of them, or engine.kind='torch' or 'vllm'"):
                Config(engine=EngineConfig(kind=kind), rollout=replayed)


def test_choice_fields_are_checked_once_on_every_path(tmp_path):
    """A Literal field is refused by the same check from a preset, from Python and (tyro first) from a flag."""
    from rollpacker.config import Config
    from rollpacker.train.config import TrainConfig

    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nrollout_correction = "maybe"\n')
    choices = "none, token_tis, seq_tis, token_mask, seq_mask"
    with pytest.raises(ValueError, match=f"bad.toml: train.rollout_correction must be one of {choices}, got 'maybe'"):
        load_preset(str(bad))
    with pytest.raises(ValueError, match=f"train.rollout_correction must be one of {choices}, got 'maybe'"):
        Config(train=TrainConfig(rollout_correction="maybe"))
    with pytest.raises(SystemExit):
        parse(["--train.rollout-correction", "maybe"])


def test_episodes_refuse_sorted_partial_with_the_reason_and_run_with_the_planner():
    from rollpacker.config import Config
    from rollpacker.env.config import EnvConfig
    from rollpacker.plan.config import PlanConfig
    from rollpacker.schedule.sorted import SortedConfig, SortedPartialConfig
    from rollpacker.train.config import TrainConfig

    env = EnvConfig(factory="toy")
    with pytest.raises(ValueError, match="schedule:sorted_partial with env.factory: partial mode keeps cut responses"
                                         ".*go on off-policy.*closes every environment.*Use schedule:sorted"):
        Config(schedule=SortedPartialConfig(), env=env, train=TrainConfig(rollout_correction="token_tis"))
    Config(env=EnvConfig(tools=("python",)), plan=PlanConfig(enabled=True))  # a TP switch lands between steps
    Config(schedule=SortedConfig(), env=env)  # on-policy sorted runs episodes
    Config(schedule=SortedPartialConfig(), train=TrainConfig(rollout_correction="token_tis"))  # no episodes: fine


def test_env_settings_are_refused_where_they_would_do_nothing(capsys):
    from rollpacker.config import Config
    from rollpacker.env.config import EnvConfig
    from rollpacker.schedule.one_step_off import OneStepOffConfig
    from rollpacker.train.config import TrainConfig

    with pytest.raises(ValueError, match="env.warm: given, but there is no environment .*: set env.factory or env.to"):
        Config(env=EnvConfig(warm=True))
    with pytest.raises(ValueError, match="^env.max_turns, env.max_tokens: given, but there is no environment"):
        Config(env=EnvConfig(max_turns=8, max_tokens=32))  # the overlong penalty had counted back from 32
    with pytest.raises(SystemExit):
        parse(["--env.tool-parser", "mistral"])
    assert "env.tool_parser: given, but there is no environment" in capsys.readouterr().err
    with pytest.raises(ValueError, match="env.warm with schedule:one_step_off: its rollout already runs beside"):
        Config(schedule=OneStepOffConfig(), env=EnvConfig(factory="toy", warm=True),
               train=TrainConfig(rollout_correction="token_tis"))
    Config(env=EnvConfig(factory="toy", warm=True))


def test_data_of_ones_own_without_a_reward_function_is_refused_naming_the_flag():
    """The default reward (toy) would score every response to other data 0, silently."""
    from rollpacker.config import Config
    from rollpacker.data.dataset import DataConfig
    from rollpacker.env.config import EnvConfig
    from rollpacker.reward.config import RewardConfig

    data = DataConfig(path=("train.jsonl",), eval_path=("test.jsonl",))
    with pytest.raises(ValueError, match=r"data.path train.jsonl without reward.funcs: the default reward \(toy\)"):
        Config(data=data)
    Config(data=data, reward=RewardConfig(funcs=("math",)))
    Config(data=data, env=EnvConfig(factory="toy"))  # the environment's rewards
    # no held-out prompts while it evaluates: refused before the job builds (it was, after minutes of loading)
    with pytest.raises(ValueError, match=r"evaluation on real data needs held-out prompts: data.eval_path .* or "
                                         r"data.eval_split .* or eval_every=0 \(now 25\)"):
        Config(data=DataConfig(path=("train.jsonl",)), reward=RewardConfig(funcs=("math",)))
    Config(data=DataConfig(path=("train.jsonl",), eval_split="train[90%:]"), reward=RewardConfig(funcs=("math",)))
    Config(data=DataConfig(path=("train.jsonl",)), reward=RewardConfig(funcs=("math",)), eval_every=0)


def test_the_zero_variance_filter_is_refused_where_equal_rewards_still_teach():
    from rollpacker.config import Config
    from rollpacker.schedule.sync import SyncConfig
    from rollpacker.train.config import TeacherConfig, TrainConfig

    for train, why in ((TrainConfig(advantage="gdpo"), "train.advantage gdpo"),
                       (TrainConfig(teacher=TeacherConfig(path="t", task_weight=0.0)), "train.teacher.path")):
        with pytest.raises(ValueError, match=f"schedule.filter_zero_variance with {why} .* drop the filter"):
            Config(schedule=SyncConfig(filter_zero_variance=True), train=train)
    Config(schedule=SyncConfig(filter_zero_variance=True))  # GRPO: an equal group's advantages are 0


def test_the_flags_a_checkpoint_keeps_for_the_export_build_the_runs_policy():
    from rollpacker.job import export_flags

    run = parse(["--model.path", "toy-tools", "--train.lora.rank", "4", "--train.lora.alpha", "8",
                 "--train.lora.target-modules", "q_proj", "v_proj", "--train.lora.export-merged"])
    again = parse([*export_flags(run), "--dist.device", "cpu"])
    assert (again.model.path, again.model.impl, again.train.lora) == (run.model.path, run.model.impl, run.train.lora)
    assert parse(export_flags(parse([]))).train.lora.rank == 0
    # a relative model.path is kept resolved: the export runs from anywhere (it named a directory of the run's cwd)
    assert export_flags(parse(["--model.path", "models/mine"]))[1] == str(Path("models/mine").resolve())


def test_the_start_summary_flags_a_toy_learning_rate_on_a_model_of_your_own():
    """The embedded defaults are the toy job's (lr 2e-4, from scratch): on a pretrained model that diverges."""
    from rollpacker.config import Config, ModelConfig
    from rollpacker.model.config import LoraConfig
    from rollpacker.summary import _training
    from rollpacker.train.config import TrainConfig

    flag = "lr 0.0002 (a toy model's: RL on a pretrained model takes about 1e-6, TRL's and verl's default; set --train"
    assert flag in _training(Config(model=ModelConfig(path="/models/Qwen2.5-7B")))
    assert "toy model's" not in _training(Config())  # the shipped toy model
    lora = Config(model=ModelConfig(path="/models/Qwen2.5-7B"), train=TrainConfig(lora=LoraConfig(rank=8)))
    assert "toy model's" not in _training(lora)  # LoRA's adapters take such rates
    tuned = Config(model=ModelConfig(path="/models/Qwen2.5-7B"), train=TrainConfig(lr=1e-6, lr_schedule="constant"))
    assert _training(tuned) == ("grpo advantages, ppo loss (token-mean), kl 0; lr 1e-06, warm-up 10 steps, then "
                                "constant")


def test_the_start_summary_flags_an_environment_of_your_own_on_the_toy_tasks_rows():
    """TRL's environments draw their own tasks: run without --data.path, their episodes started from toy arithmetic
    problems (the reset's text after them), and nothing said so."""
    from rollpacker.summary import _toy_under

    env = ["--env.factory", "rollpacker.toy.env:make_env"]  # as a file of the user's would be named
    assert "gets a toy arithmetic problem as its row, and as its prompt unless its reset" in _toy_under(parse(env))
    assert _toy_under(parse([*env, "--data.path", "rows.jsonl", "--eval-every", "0"])) == ""
    assert _toy_under(parse(["--env.factory", "toy"])) == _toy_under(parse([])) == ""  # the toy environment's task


def test_a_rollout_replica_that_would_span_two_nodes_is_refused(monkeypatch):
    """rollout.tp groups consecutive ranks: 2 nodes of 2 ranks with rollout.tp 4 (or of 3 with tp 2) put one
    replica on both nodes, which only the planner's TPs avoided; SGLang's leader then started schedulers on GPUs its
    node does not have."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rollout.tp=4 does not divide the 2 ranks of a node \(LOCAL_WORLD_SIZE\)"):
        parse(["--rollout.tp", "4"]).check_world(4)
    parse(["--rollout.tp", "2"]).check_world(4)
    parse(["--rollout.tp", "4", "--plan.enabled"]).check_world(4)  # rollout.tp unread: the planner's stay in a node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    parse(["--rollout.tp", "4"]).check_world(4)  # one node


@pytest.mark.parametrize("flags, planned", [([], 50), (["--num-epochs", "1"], 2), (["--num-epochs", "3"], 6),
                                             (["--num-epochs", "3", "--num-steps", "5"], 5)])
def test_the_start_summary_and_the_eta_count_the_steps_num_epochs_leaves(flags, planned):
    """8 rows, 4 prompts a step: --num-epochs 1 --num-steps 50 said "steps 0 to 49", and the ETA counted 50 steps, for
    a run done after 2."""
    from types import SimpleNamespace

    from rollpacker.data.dataset import PromptSampler
    from rollpacker.summary import planned_steps

    cfg = parse(["--num-steps", "50", "--rollout.num-prompts", "4", *flags])
    sampler = PromptSampler(8, 0)
    policy = cfg.schedule.build(sampler, 4, cfg.rollout.group_size, num_epochs=cfg.num_epochs)
    job = SimpleNamespace(config=cfg, controller=SimpleNamespace(policy=policy), start_step=0)
    assert planned_steps(job) == planned
    assert planned_steps(SimpleNamespace(config=cfg, controller=SimpleNamespace(policy=object()), start_step=0)) == (
        cfg.num_steps)  # a policy of the user's, without a sampler
    if planned == 6:  # resumed after a step: the rows left decide
        sampler.draw(4)
        job.start_step = 1
        assert planned_steps(job) == 6
        tail = parse(["schedule:tail", "--num-epochs", "3"]).schedule.build(sampler, 4, 2, num_epochs=3)
        for key in sampler.draw(4):  # step 1 drew 4 and deferred them: they are trained too
            tail.ledger.launch(key)
            tail.ledger.settle(key, "deferred")
        job.controller.policy, job.start_step = tail, 2
        assert planned_steps(job) == 2 + -(-(16 + 4) // 4)


def test_the_start_summary_counts_the_data_sources_it_does_not_name():
    """Rows without a data_source counted as one more source: "and 1 more sources" after all five there are."""
    from rollpacker.summary import _rows

    five = [{"data_source": s} for s in "abcde" for _ in range(3)]
    assert _rows(five + [{}], ("d.jsonl",)) == "16 rows from d.jsonl (sources: a 3, b 3, c 3, d 3, e 3)"
    assert _rows(five + [{"data_source": "f"}] + [{}] * 9, ()).endswith("e 3 and 1 more sources)")


def test_a_resume_says_which_settings_differ_from_the_checkpoints_run(caplog):
    """Another preset whose model has the same shapes resumed silently: another task, chat template and rewards
    under the checkpoint's weights and data position. Where the run writes and the optimizer's settings (which
    the trainer says as it applies them) are left unsaid."""
    from rollpacker.job import say_changed, settings

    saved = json.loads(json.dumps(settings(parse(["--preset", "toy-tools"]))))  # as train_state.json holds them
    say_changed(saved, parse(["--preset", "toy-tools", "--run-dir", "elsewhere", "--train.lr", "1e-5",
                              "--metrics.wandb-mode", "disabled"]))
    assert caplog.text == ""
    say_changed(saved, parse(["--preset", "toy-env", "--train.lr-schedule", "constant"]))
    [record] = caplog.records
    assert "model.path: 'toy-tools' -> '', data.toy_task: 'tools' -> 'arithmetic'" in record.getMessage()
    assert "env.factory: '' -> 'toy'" in record.getMessage() and record.levelname == "WARNING"
    assert "train.lr_schedule: 'cosine' -> 'constant'" in record.getMessage()  # not the optimizer's train.lr


def test_a_setting_json_cannot_hold_is_kept_as_text_without_its_address():
    """A user policy's setting holding an object was kept as its repr, whose address differs in every process:
    every resume said it changed."""
    from rollpacker.job import settings

    @dataclasses.dataclass
    class Knobs:
        pick: object = dataclasses.field(default_factory=object)

    assert settings(Knobs()) == settings(Knobs()) == {"pick": "<object object>"}


def test_the_start_summary_says_tools_render_every_prompt_and_reward_nothing_themselves():
    """With env.tools a string prompt goes through the chat template too (their schemas with it): the summary said
    only message lists did; and tools alone have no reward of the environment's to name."""
    from types import SimpleNamespace

    from rollpacker.summary import _rewards, _template

    tokenizer = SimpleNamespace(chat_template="{{ messages }}")
    assert _template(tokenizer, parse(["--env.tools", "python"])).endswith("renders every prompt, with the tools' "
                                                                           "schemas (--env.tools)")
    assert _template(tokenizer, parse([])).endswith("renders message-list prompts")
    functions = [SimpleNamespace(name="toy", weight=1.0)]
    ctl = SimpleNamespace(rewards=SimpleNamespace(functions=functions), config=parse(["--env.tools", "python"]))
    assert _rewards(ctl) == "toy x1 (correct: the reward >= 1)"
    ctl.config = parse(["--env.factory", "toy"])
    assert _rewards(ctl) == "toy x1, the environment's (correct: the reward >= 1)"


def test_a_warning_of_ours_names_settings_as_the_flags_you_type():
    """Errors said --data.skip-bad-lines, warnings data.skip_bad_lines: the docs quote them as flags. A bad format
    argument stays the handler's to report (a filter's exception would raise at the call, mid-step)."""
    import logging

    from rollpacker.run import flag_names

    def said(name: str, level: int, msg: str, *args) -> str:
        record = logging.LogRecord(name, level, __file__, 0, msg, args, None)
        assert flag_names(record)
        return record.getMessage()

    assert said("rollpacker.data", logging.WARNING, "skipped %d bad row(s) (data.skip_bad_lines)", 2) == (
        "skipped 2 bad row(s) (--data.skip-bad-lines)")
    assert said("rollpacker", logging.INFO, "resume: train.lr: 1 -> 2") == "resume: --train.lr: 1 -> 2"
    assert said("transformers", logging.WARNING, "see num_steps") == "see num_steps"  # not ours
    with pytest.raises(TypeError):  # a bad format argument: the handler says so, as it would without the filter
        said("rollpacker", logging.WARNING, "after %d", "oops")


def test_a_stream_fetch_cap_below_one_group_is_refused():
    """stream.fetch_cap x num_prompts < 1 took no group at its one fetch: the round scaled down for nothing."""
    from rollpacker.config import Config
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.schedule.scale_down import StreamConfig

    with pytest.raises(ValueError, match=r"stream.fetch_cap=0.2 of rollout.num_prompts=4 groups is less than one "
                                         r"group: set it to 0.25 or more"):
        Config(stream=StreamConfig(enabled=True, fetch_cap=0.2), rollout=RolloutConfig(num_prompts=4))
    Config(stream=StreamConfig(enabled=True, fetch_cap=0.25), rollout=RolloutConfig(num_prompts=4))
    with pytest.raises(ValueError, match=r"set it to 0.008 or more"):  # rounded up: 0.00781 x 128 is below one
        Config(stream=StreamConfig(enabled=True, fetch_cap=0.0078), rollout=RolloutConfig(num_prompts=128))
    Config(stream=StreamConfig(enabled=True, fetch_cap=1 / 49), rollout=RolloutConfig(num_prompts=49))  # 0.99999..


def test_max_gen_batches_is_refused_where_no_round_refills():
    """sorted and one_step_off never pass it on, sync refills only with schedule.refill: it was unread, unsaid."""
    from rollpacker.schedule.one_step_off import OneStepOffConfig
    from rollpacker.schedule.sorted import SortedConfig
    from rollpacker.schedule.sync import SyncConfig

    for make, settings in ((SortedConfig, {}), (OneStepOffConfig, {}), (SyncConfig, {"filter_zero_variance": True})):
        with pytest.raises(ValueError, match=f"schedule.max_gen_batches with schedule:{make.name}: it bounds"):
            make(max_gen_batches=3, **settings)
    for flags in (["schedule:sync", "--schedule.filter-zero-variance", "--schedule.refill",
                   "--schedule.max-gen-batches", "3"],
                  ["schedule:tail", "--schedule.filter-zero-variance", "--schedule.max-gen-batches", "3"]):
        assert parse(flags).schedule.max_gen_batches == 3


def test_a_trl_or_verl_settings_name_is_answered_with_rollpackers_flag(capsys):
    """--train.beta was offered AdamW's --train.betas, and --rollout.n (verl's) --rollout.longest-first: a flag the
    parser does not know that is TRL's or verl's name gets one line naming rollpacker's; a known one (--eval.n)
    gets none."""
    from rollpacker.run import parse_once

    with pytest.raises(SystemExit):
        parse_once(["--train.beta", "0.04", "--eval.n", "2", "--rollout.n", "8", "--num_generations=4", "--oops"])
    err = capsys.readouterr().err
    assert err.rstrip().endswith("rollpacker: --train.beta: TRL's beta is --train.kl-coef\n"
                                 "rollpacker: --rollout.n: verl's n is --rollout.group-size\n"
                                 "rollpacker: --num_generations: TRL's num_generations is --rollout.group-size"), err
    assert "--eval.n:" not in err and "--oops:" not in err and "Hydra" not in err
    with pytest.raises(SystemExit):  # verl's own spelling, Hydra's overrides
        parse_once(["data.train_files=x.parquet", "actor_rollout_ref.rollout.n=8", "trainer.logger=wandb"])
    err = capsys.readouterr().err
    assert err.rstrip().endswith("rollpacker: data.train_files=...: verl's train_files is --data.path\n"
                                 "rollpacker: actor_rollout_ref.rollout.n=...: verl's n is --rollout.group-size\n"
                                 "rollpacker: a setting is a flag, --section.name VALUE, not Hydra's "
                                 "section.name=VALUE"), err
