"""Studies: arm expansion and the budget against hand-worked cases, refusals naming the field, resume, the report's
numbers against the members' files, and (slow) a two-arm study run end to end by `agentgym study`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentgym.local.study import deep_merge, load_study, mean_se, parse_study, run_study, study_report
from agentgym.spec import SpecError

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def base() -> dict[str, Any]:
    return {
        "apiVersion": "agentgym.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "base"},
        "spec": {
            "model": {"name": "builtin:tiny", "dtype": "float32", "maxContextTokens": 1024},
            "environments": [{"name": "babyai", "maxEpisodes": 16}],
            "algorithm": {"name": "grpo", "groupSize": 2, "klCoef": 0.0, "miniBatchSize": 2},
            "curriculum": {"kind": "scaling_inter", "horizons": [2, 3], "stageSteps": 1},
            "rollout": {"tasksPerStep": 1, "maxTokensPerTurn": 8, "concurrency": 4},
            "inference": {"engine": "hf", "gpusPerReplica": 0, "maxBatchSize": 4},
            "trainer": {"totalSteps": 2, "checkpointEvery": 1},
        },
    }


def study(arms: list[dict[str, Any]], seeds: list[int] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "agentgym.io/v1alpha1",
        "kind": "Study",
        "metadata": {"name": "hz"},
        "spec": {"base": base(), "seeds": seeds or [1, 2], "arms": arms, **spec},
    }


ARMS = [
    {"name": "short", "overrides": {"curriculum": {"kind": "fixed", "maxTurns": 2}}},
    {"name": "staged", "overrides": {"curriculum": {"horizons": [2, 4]}, "rollout": {"temperature": 0.7}}},
]


def test_arms_expand_seed_major_with_their_overrides_and_one_budget() -> None:
    expanded = parse_study(study(ARMS))
    assert [(m.arm, m.seed) for m in expanded.members] == [("short", 1), ("staged", 1), ("short", 2), ("staged", 2)]
    first, second = expanded.members[0].run, expanded.members[1].run
    assert first.metadata.name == "hz-short-s1" and expanded.members[3].run.metadata.name == "hz-staged-s2"
    assert first.metadata.labels == {"agentgym.io/study": "hz", "agentgym.io/arm": "short", "agentgym.io/seed": "1"}
    assert (first.spec.curriculum.kind, first.spec.curriculum.max_turns) == ("fixed", 2)
    # Merged key by key: the staged arm keeps the base's kind and stageSteps, replaces the horizons list whole.
    assert (second.spec.curriculum.kind, second.spec.curriculum.horizons) == ("scaling_inter", [2, 4])
    assert second.spec.curriculum.stage_steps == 1 and second.spec.rollout.temperature == 0.7
    assert second.spec.rollout.max_tokens_per_turn == 8  # untouched parts of the same section stay
    assert [m.run.spec.trainer.seed for m in expanded.members] == [1, 1, 2, 2]
    assert expanded.episodes_per_run == 2 * 1 * 2  # totalSteps x tasksPerStep x groupSize
    assert expanded.eval_max_turns == 4  # the longest final horizon: fixed 2, staged [2, 4]
    assert parse_study(study(ARMS, evalMaxTurns=6)).eval_max_turns == 6


def test_deep_merge_replaces_lists_and_scalars_and_merges_mappings() -> None:
    merged = deep_merge({"a": {"b": 1, "c": [1, 2]}, "d": 1}, {"a": {"c": [3]}, "d": {"e": 2}})
    assert merged == {"a": {"b": 1, "c": [3]}, "d": {"e": 2}}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"trainer": {"totalSteps": 5}}, "spec.arms[1] (x).overrides.trainer.totalSteps"),
        ({"rollout": {"tasksPerStep": 3}}, "spec.arms[1] (x).overrides.rollout.tasksPerStep"),
        ({"algorithm": {"groupSize": 4}}, "spec.arms[1] (x).overrides.algorithm.groupSize"),
        ({"trainer": {"seed": 9}}, "spec.arms[1] (x).overrides.trainer.seed"),
    ],
)
def test_an_arm_cannot_change_the_budget_or_the_seed(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_study(study([ARMS[0], {"name": "x", "overrides": overrides}]))
    assert any(line.startswith(field + ": an arm cannot override it") for line in refused.value.errors)


@pytest.mark.parametrize(
    ("document_patch", "line"),
    [
        ({"arms": [{"name": "bad", "overrides": {"curriculum": {"maxTurns": 0}}}]},
         "spec.arms[0] (bad): spec.curriculum.maxTurns: Input should be greater than or equal to 1"),
        ({"arms": [{"name": "bad", "overrides": {"curriculm": {}}}]},
         "spec.arms[0] (bad): spec.curriculm: Extra inputs are not permitted"),
        ({"seeds": [1, 1]}, "spec.seeds: seeds must be distinct, got [1, 1]"),
        ({"arms": [ARMS[0], ARMS[0]]}, "spec.arms: arm names must be distinct, got ['short', 'short']"),
        ({"arms": [{"name": "Bad_Name"}]}, "spec.arms[0].name: String should match pattern"),
        ({"base": "nowhere.yaml"}, "spec.base: "),
        ({"evalMaxTurns": 0}, "spec.evalMaxTurns: Input should be greater than or equal to 1"),
        # Base: 2 steps; stages [2, 3, 4] of one step each: horizon 4 would start at step 2, after the budget.
        ({"arms": [{"name": "late", "overrides": {"curriculum": {"horizons": [2, 3, 4]}}}]},
         "spec.arms[0] (late).overrides.curriculum.stageSteps: the last stage (horizon 4) starts at step 2, past"),
    ],
)  # fmt: skip
def test_bad_studies_are_refused_naming_the_field(document_patch: dict[str, Any], line: str, tmp_path: Path) -> None:
    document = study(ARMS)
    document["spec"].update(document_patch)
    with pytest.raises(SpecError) as refused:
        parse_study(document, tmp_path)
    assert any(error.startswith(line) for error in refused.value.errors), refused.value.errors


def test_every_example_is_a_training_run_or_a_study_and_the_horizon_study_validates() -> None:
    for path in sorted(EXAMPLES.glob("*.yaml")):
        kind = yaml.safe_load(path.read_text())["kind"]
        assert kind in ("TrainingRun", "Study"), path
    horizons = load_study(EXAMPLES / "study-horizons.yaml")
    assert [arm.name for arm in horizons.arms] == ["fixed-short", "fixed-long", "scaling-inter", "adaptive"]
    assert len(horizons.members) == 12 and horizons.eval_max_turns == 12 and horizons.eval_tasks == 75
    assert {m.run.spec.environments[0].split for m in horizons.members} == {"train-doors"}
    assert horizons.episodes_per_run == 24 * 4 * 8  # the quickstart's budget for every arm
    kinds = {m.arm: m.run.spec.curriculum.kind for m in horizons.members}
    assert kinds == {"fixed-short": "fixed", "fixed-long": "fixed", "scaling-inter": "scaling_inter",
                     "adaptive": "adaptive"}  # fmt: skip


def write_member(directory: Path, phase: str | None, checkpoint: bool = False) -> None:
    directory.mkdir(parents=True)
    (directory / "spec.yaml").write_text("kind: TrainingRun\n")
    if phase:
        (directory / "status.json").write_text(json.dumps({"phase": phase}))
    if checkpoint:
        (directory / "checkpoints" / "step-1").mkdir(parents=True)


def test_a_rerun_skips_finished_members_and_resumes_a_half_finished_one(tmp_path: Path) -> None:
    expanded = parse_study(study(ARMS))
    write_member(tmp_path / "short" / "seed-1", "Succeeded")
    write_member(tmp_path / "staged" / "seed-1", "Running", checkpoint=True)  # stopped after a checkpoint
    write_member(tmp_path / "short" / "seed-2", "Failed")  # failed before its first checkpoint
    (tmp_path / "short" / "seed-2" / "metrics.jsonl").write_text('{"step": 0}\n')  # its partial record
    calls: list[list[str]] = []

    def run(args: list[str]) -> int:
        calls.append(args)
        run_dir = Path(args[args.index("--run-dir") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "status.json").write_text(json.dumps({"phase": "Succeeded"}))
        return 0

    said: list[str] = []
    outcome = run_study(expanded, tmp_path, run, say=said.append)
    assert outcome == dict.fromkeys(["short/seed-1", "staged/seed-1", "short/seed-2", "staged/seed-2"], "done")
    assert [Path(c[c.index("--run-dir") + 1]).relative_to(tmp_path).as_posix() for c in calls] == [
        "staged/seed-1", "short/seed-2", "staged/seed-2",
    ]  # fmt: skip
    assert "--resume" in calls[0] and "--resume" not in calls[1] and "--resume" not in calls[2]
    assert all(c[c.index("--eval-max-turns") + 1] == "4" for c in calls)
    assert said[0] == "[1/4] short/seed-1: done, skipped"
    assert said[3] == "[3/4] short/seed-2: starting"
    assert not (tmp_path / "short" / "seed-2" / "metrics.jsonl").exists()  # no checkpoint: started afresh
    # The study as run, and each member's spec, are in the study directory.
    assert yaml.safe_load((tmp_path / "study.yaml").read_text())["spec"]["evalMaxTurns"] == 4
    member_spec = yaml.safe_load((tmp_path / "staged" / "seed-2.yaml").read_text())
    assert member_spec["metadata"]["name"] == "hz-staged-s2" and member_spec["spec"]["trainer"]["seed"] == 2
    # A member that fails is reported, and a rerun picks it up again.
    assert run_study(expanded, tmp_path, lambda args: 1, say=said.append) == dict.fromkeys(outcome, "done")


def warmed_base(**trainer: Any) -> dict[str, Any]:
    document = base()
    # GoTo levels: their expert demonstrations fit the base's 1,024-token context.
    document["spec"]["environments"][0].update({"split": "train-easy", "evalSplit": "test-easy"})
    document["spec"]["trainer"].update({"sftWarmupSteps": 2, "sftTasks": 4, **trainer})
    return document


def test_a_base_with_a_warm_up_shares_it_per_seed_and_arms_may_override_only_what_it_does_not_read() -> None:
    assert parse_study(study(ARMS)).shared_warmup is False  # no warm-up in the base: each member is as it is
    shared = parse_study({**study(ARMS), "spec": {**study(ARMS)["spec"], "base": warmed_base()}})
    assert shared.shared_warmup is True and shared.document()["spec"]["sharedWarmup"] is True
    arms = [*ARMS, {"name": "x", "overrides": {"trainer": {"checkpointEvery": 2}, "model": {"maxContextTokens": 512}}}]
    document = study(arms)
    document["spec"]["base"] = warmed_base()
    with pytest.raises(SpecError) as refused:
        parse_study(document)
    assert [line.split(":")[0] for line in refused.value.errors] == [
        "spec.arms[2] (x).overrides.model", "spec.arms[2] (x).overrides.trainer",
    ]  # fmt: skip
    assert "or set sharedWarmup: false" in refused.value.errors[0]
    document["spec"]["sharedWarmup"] = False  # each member warms itself up: any override
    assert parse_study(document).shared_warmup is False
    with pytest.raises(SpecError) as nothing_to_share:
        parse_study(study(ARMS, sharedWarmup=True))
    assert nothing_to_share.value.errors == [
        "spec.sharedWarmup: the base has no warm-up to share (its trainer.sftWarmupSteps is 0)"
    ]


def test_each_seed_warms_up_once_and_its_arms_start_rl_from_that_policy(tmp_path: Path) -> None:
    document = study(ARMS)
    document["spec"]["base"] = warmed_base()
    expanded = parse_study(document)
    calls: list[list[str]] = []
    failing_seeds: set[str] = set()

    def run(args: list[str]) -> int:
        calls.append(args)
        if args[0] == "sft":
            seed = yaml.safe_load(Path(args[1]).read_text())["spec"]["trainer"]["seed"]
            if str(seed) in failing_seeds:
                return 1
            policy = Path(args[args.index("--output-dir") + 1]) / "checkpoints" / "step-0"
            policy.mkdir(parents=True)
            (policy / "trainer_state.json").write_text(json.dumps({"sft_done": True}))
            return 0
        run_dir = Path(args[args.index("--run-dir") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "status.json").write_text(json.dumps({"phase": "Succeeded"}))
        return 0

    failing_seeds.add("2")
    said: list[str] = []
    outcome = run_study(expanded, tmp_path, run, say=said.append)
    assert outcome == {"short/seed-1": "done", "staged/seed-1": "done", "short/seed-2": "failed",
                       "staged/seed-2": "failed"}  # fmt: skip
    # One warm-up per seed (a failed one is not retried for each arm), before that seed's members.
    assert [c[0] for c in calls] == ["sft", "run", "run", "sft"]
    warmup_spec = yaml.safe_load(Path(calls[0][1]).read_text())
    assert warmup_spec["metadata"]["name"] == "hz-warmup-s1" and warmup_spec["spec"]["trainer"]["seed"] == 1
    assert warmup_spec["spec"]["trainer"]["sftWarmupSteps"] == 2
    policy = tmp_path / "warmup" / "seed-1" / "checkpoints" / "step-0"
    for arm in ("short", "staged"):
        member = yaml.safe_load((tmp_path / arm / "seed-1.yaml").read_text())["spec"]
        assert member["model"]["name"] == str(policy.resolve()) and member["trainer"]["sftWarmupSteps"] == 0
        assert member["trainer"]["seed"] == 1
    assert "[3/4] short/seed-2: failed (no warm-up for seed 2)" in said
    # A rerun makes the missing warm-up only: seed 1's is kept (its members are done anyway).
    failing_seeds.clear()
    calls.clear()
    assert set(run_study(expanded, tmp_path, run, say=said.append).values()) == {"done"}
    assert [c[0] for c in calls] == ["sft", "run", "run"]
    assert "hz-warmup-s2" in Path(calls[0][1]).read_text()


def test_mean_and_standard_error_over_seeds() -> None:
    mean, se = mean_se([0.2, 0.4, 0.9])
    assert mean == pytest.approx(0.5)
    assert se == pytest.approx(math.sqrt(((0.3**2) + (0.1**2) + (0.4**2)) / 2) / math.sqrt(3))
    assert mean_se([0.3]) == (0.3, None) and math.isnan(mean_se([])[0])


def member_files(
    directory: Path,
    end_success: float,
    success: list[float],
    horizons: list[int],
    phase: str = "Succeeded",
    evals: dict[str, float] | None = None,
) -> None:
    directory.mkdir(parents=True)
    (directory / "spec.yaml").write_text("{}")
    (directory / "status.json").write_text(json.dumps({"phase": phase}))
    rows = [{"step": 0, "sft/sft_loss": 3.0, "sft/sft_step": 0.0, "env": {}}]
    for step, (rate, horizon) in enumerate(zip(success, horizons, strict=True)):
        stats = {"success_rate": rate, "reward_mean": rate, "turns_mean": horizon - 0.5, "trajectories": 4.0,
                 "truncation_rate": 0.5, "invalid_action_rate": 0.1}  # fmt: skip
        rows.append({"step": step, "policy_loss": 0.1, "horizon": horizon, "entropy": 1.0, "env": {"all": stats}})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "eval").mkdir()
    phases = {name: {"success": value} for name, value in (evals or {}).items()} | {"end": {"success": end_success}}
    summary = {"phases": phases, "seconds": {"trainer_started": 5.0, "trainer_done": 65.0}}
    (directory / "eval" / "summary.json").write_text(json.dumps(summary))


def test_the_report_puts_the_arms_side_by_side_from_the_members_files(tmp_path: Path) -> None:
    expanded = parse_study(study(ARMS))
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(expanded.document()))
    member_files(tmp_path / "short" / "seed-1", 0.2, [0.0, 0.5], [2, 2], evals={"start": 0.0, "sft": 0.1})
    member_files(tmp_path / "short" / "seed-2", 0.4, [0.5, 1.0], [2, 2], evals={"start": 0.0, "sft": 0.3})
    member_files(tmp_path / "staged" / "seed-1", 0.6, [0.0, 0.25], [2, 4])
    member_files(tmp_path / "staged" / "seed-2", 0.9, [0.9], [2], phase="Running")  # half-way: left out
    result = study_report(tmp_path)
    short, staged = result["summary"]["arms"]
    assert (short["arm"], short["seeds"], staged["seeds"]) == ("short", 2, 1)
    assert (short["unfinished"], staged["unfinished"]) == ([], [2])
    assert short["end_success"] == pytest.approx(0.3)
    assert short["end_success_se"] == pytest.approx(math.sqrt(0.02) / math.sqrt(2))  # stdev of (0.2, 0.4) / sqrt 2
    assert staged["end_success"] == 0.6 and staged["end_success_se"] is None
    assert short["warmup_success"] == pytest.approx(0.2)  # each member's own warm-up: its `sft` eval
    assert math.isnan(staged["warmup_success"])
    # Environment steps: trajectories x mean turns, summed over the steps (4 x 1.5 + 4 x 1.5; 4 x 1.5 + 4 x 3.5).
    assert short["environment_steps"] == 12.0 and staged["environment_steps"] == 20.0
    assert short["train_seconds"] == 60.0
    curves = result["summary"]["curves"]
    assert curves["short"]["steps"] == [0, 1]
    assert curves["short"]["success_rate"]["mean"] == [0.25, 0.75]
    assert curves["short"]["success_rate"]["se"] == [pytest.approx(0.25), pytest.approx(0.25)]
    assert curves["staged"]["horizon"]["mean"] == [2.0, 4.0]
    assert "short" in result["text"] and "0.30 ± 0.10" in result["text"] and "0.60" in result["text"]
    assert "unfinished (left out): staged seed 2" in result["text"]
    assert result["figure"].stat().st_size > 10_000
    cli = subprocess.run([*AGENTGYM, "report", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "0.30 ± 0.10" in cli.stdout


def test_with_a_shared_warm_up_the_report_takes_the_start_eval_as_the_warm_up(tmp_path: Path) -> None:
    document = study(ARMS)
    document["spec"]["base"] = warmed_base()
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(parse_study(document).document()))
    member_files(tmp_path / "short" / "seed-1", 0.2, [0.0], [2], evals={"start": 0.25})
    member_files(tmp_path / "short" / "seed-2", 0.4, [0.5], [2], evals={"start": 0.35})
    short = study_report(tmp_path)["summary"]["arms"][0]
    assert short["warmup_success"] == pytest.approx(0.3) and short["warmup_success_se"] == pytest.approx(0.05)


def test_the_cli_refuses_a_bad_study_and_emits_cluster_runs(tmp_path: Path) -> None:
    bad = study([{"name": "x", "overrides": {"trainer": {"totalSteps": 9}}}])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    refused = subprocess.run([*AGENTGYM, "study", str(path)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "overrides.trainer.totalSteps" in refused.stderr
    taken = tmp_path / "a-file"
    taken.write_text("x")
    good_document = tmp_path / "ok.yaml"
    good_document.write_text(yaml.safe_dump(study(ARMS)))
    for option in ("--study-dir", "--emit"):
        clash = subprocess.run([*AGENTGYM, "study", str(good_document), option, str(taken)], capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert clash.returncode == 2 and "is not a directory" in " ".join(clash.stderr.split()), option
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(study(ARMS, seeds=[3])))
    out = tmp_path / "cluster"
    emitted = subprocess.run([*AGENTGYM, "study", str(good), "--emit", str(out)], capture_output=True, text=True)
    assert emitted.returncode == 0, emitted.stderr
    documents = [yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))]
    assert [d["metadata"]["name"] for d in documents] == ["hz-short-s3", "hz-staged-s3"]
    assert {d["metadata"]["labels"]["agentgym.io/study"] for d in documents} == {"hz"}


@pytest.mark.slow
def test_a_two_arm_study_runs_end_to_end_and_a_rerun_skips_it(tmp_path: Path) -> None:
    document = study([ARMS[0], {"name": "long", "overrides": {"curriculum": {"kind": "fixed", "maxTurns": 3}}}], [1])
    document["spec"]["base"] = warmed_base(totalSteps=1)  # the seed's warm-up, shared by both arms
    document["spec"]["evalTasks"] = 4
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(document))
    study_dir = tmp_path / "out"
    command = [*AGENTGYM, "study", str(path), "--study-dir", str(study_dir)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert first.stdout.count("warm-up of seed 1: starting") == 1 and "warm-up of seed 1: done" in first.stdout
    policy = study_dir / "warmup" / "seed-1" / "checkpoints" / "step-0"
    assert (policy / "config.json").is_file()
    for arm in ("short", "long"):
        status = json.loads((study_dir / arm / "seed-1" / "status.json").read_text())
        assert status["phase"] == "Succeeded" and status["metrics"]["eval/end/horizon"] == 3
        # RL started from the shared warm-up's policy, measured at `start`, with no warm-up of its own.
        assert yaml.safe_load((study_dir / arm / "seed-1" / "spec.yaml").read_text())["spec"]["model"]["name"] == (
            str(policy.resolve())
        )
        phases = json.loads((study_dir / arm / "seed-1" / "eval" / "summary.json").read_text())["phases"]
        assert set(phases) == {"start", "end"}
    assert "study hz: held-out success at the end" in first.stdout
    assert (study_dir / "report" / "study.png").stat().st_size > 10_000
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done, skipped") == 2
