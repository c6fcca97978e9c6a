"""BabyAIEnv: observations, macro actions, invalid actions, reward, truncation, quietness."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable, Iterator

import gymnasium
import numpy as np
import pytest
from minigrid.core.world_object import Door

import agentgym.envs
from agentgym.envs import StepResult
from agentgym.envs.babyai.engine import _DiscardWriter
from agentgym.envs.babyai.env import BabyAIEnv, normalize_action
from agentgym.envs.babyai.expert import BabyAIExpert
from agentgym.envs.babyai.levels import LEVELS, gym_id, parse_task_id
from agentgym.envs.babyai.world import DIR_VECS, KnownObject
from agentgym.envs.base import EpisodeNotStartedError

OBJECT_NAME = r"(red|green|blue|purple|yellow|grey) (door|key|ball|box) \d+"


@pytest.fixture
def env() -> Iterator[BabyAIEnv]:
    instance = BabyAIEnv()
    yield instance
    instance.close()


def _test_ids() -> list[str]:
    return list(BabyAIEnv.catalog().task_ids("test"))


def _assert_valid(result: StepResult) -> None:
    assert not result.info["invalid_action"], result.observation


def _assert_invalid(result: StepResult, env: BabyAIEnv, steps_before: int) -> None:
    assert result.info["invalid_action"] is True
    assert result.reward == 0.0
    assert result.info["primitive_steps"] == 0
    assert env.level_env.step_count == steps_before
    assert "Available actions:" in result.observation
    assert result.available_actions == env.available_actions()


# -- construction and observations ---------------------------------------------------------------


def test_make_and_reset_through_registry() -> None:
    env = agentgym.envs.make("babyai")
    assert isinstance(env, BabyAIEnv)
    assert env.name == "babyai"
    first = env.reset(env.catalog().task_id("test", 0))
    assert first.observation.startswith("Your goal: ")
    assert first.available_actions and "turn left" in first.available_actions
    assert isinstance(agentgym.envs.make_expert("babyai"), BabyAIExpert)


def test_step_before_reset_raises(env: BabyAIEnv) -> None:
    with pytest.raises(EpisodeNotStartedError):
        env.step("turn left")
    with pytest.raises(EpisodeNotStartedError):
        env.observe()
    assert env.available_actions() is None


def test_reset_observation_content(env: BabyAIEnv) -> None:
    first = env.reset("GoToRedBall/s0")
    level = env.level_env
    obs = first.observation
    assert obs.splitlines()[0] == f"Your goal: {level.mission}"
    assert first.info["mission"] == level.mission
    assert first.info["level"] == "GoToRedBall" and first.info["seed"] == 0 and first.info["split"] == "test"
    assert first.info["max_steps"] == level.max_steps
    assert "In view:" in obs
    assert "You are not carrying anything." in obs
    assert "Right in front of you:" in obs
    assert obs.rstrip().splitlines()[-1] == "Available actions: " + ", ".join(first.available_actions or [])
    # Every object line names an object and gives its position in steps.
    object_lines = [line for line in obs.splitlines() if line.startswith("- ")]
    assert object_lines
    for line in object_lines:
        assert re.match(rf"^- {OBJECT_NAME}( \((open|closed|locked)\))?: \d+ steps? ", line), line
    assert env.observe() == obs


def test_object_positions_match_the_grid(env: BabyAIEnv) -> None:
    """'N steps in front and M steps to your right' points at the named object's cell."""
    for task_id in _test_ids()[:40]:
        env.reset(task_id)
        level = env.level_env
        ax, ay = int(level.agent_pos[0]), int(level.agent_pos[1])
        fx, fy = DIR_VECS[level.agent_dir]
        rx, ry = -fy, fx
        for line in env.observe().splitlines():
            match = re.match(rf"^- ({OBJECT_NAME})(?: \(\w+\))?: (.*)$", line)
            if not match:
                continue
            where = match[4]
            front = _signed(where, r"(\d+) steps? in front", r"(\d+) steps? behind")
            right = _signed(where, r"(\d+) steps? to your right", r"(\d+) steps? to your left")
            cell = level.grid.get(ax + front * fx + right * rx, ay + front * fy + right * ry)
            known = env.world.by_name(match[1])
            assert known is not None and cell is known.obj, (task_id, line)
            assert f"{cell.color} {cell.type}" == " ".join(match[1].split()[:2])


def _signed(text: str, positive: str, negative: str) -> int:
    if found := re.search(positive, text):
        return int(found[1])
    if found := re.search(negative, text):
        return -int(found[1])
    return 0


def test_door_states_are_described(env: BabyAIEnv) -> None:
    seen_states = set()
    for task_id in _test_ids()[:200]:
        env.reset(task_id)
        for known in env.world.in_view:
            if isinstance(known.obj, Door):
                state = "open" if known.obj.is_open else "locked" if known.obj.is_locked else "closed"
                assert f"- {known.name} ({state}):" in env.observe()
                seen_states.add(state)
    assert {"closed", "locked"} <= seen_states  # doors start closed; "open" is covered by the toggle tests


def test_reset_is_deterministic(env: BabyAIEnv) -> None:
    other = BabyAIEnv()
    for task_id in ["BossLevel/s3", "KeyCorridorS6R3/s1000123", "GoToRedBall/s7"]:
        first = env.reset(task_id)
        env.step("turn left")
        again = env.reset(task_id)  # same instance, after acting
        fresh = other.reset(task_id)  # another instance
        assert first.observation == again.observation == fresh.observation
        assert first.available_actions == fresh.available_actions
        assert np.array_equal(env.level_env.grid.encode(), other.level_env.grid.encode())


def test_objects_keep_their_names(env: BabyAIEnv) -> None:
    env.reset("GoToRedBall/s0")
    names = {id(k.obj): k.name for k in env.world.objects}
    for action in ["turn left", "turn left", "move forward", "turn right"]:
        env.step(action)
    for known in env.world.objects:
        if id(known.obj) in names:
            assert names[id(known.obj)] == known.name
    assert len({k.name for k in env.world.objects}) == len(env.world.objects)


def test_only_seen_objects_are_offered(env: BabyAIEnv) -> None:
    for task_id in _test_ids()[:80]:
        first = env.reset(task_id)
        named = {k.name for k in env.world.objects}
        for action in first.available_actions or []:
            match = re.match(rf"^(go to|pick up|toggle) ({OBJECT_NAME})$", action)
            if match:
                assert match[2] in named
                assert match[2] in first.observation
        # Every named object's cell has been seen.
        for known in env.world.objects:
            assert known.pos is not None and env.world.seen[known.pos]


# -- macro actions ---------------------------------------------------------------------------------


def test_turns_and_move_forward(env: BabyAIEnv) -> None:
    env.reset("GoToRedBall/s0")
    level = env.level_env
    direction = level.agent_dir
    result = env.step("turn left")
    _assert_valid(result)
    assert level.agent_dir == (direction - 1) % 4
    assert result.info["primitive_steps"] == 1 and result.info["step_count"] == 1
    assert result.observation.startswith("You turned left.")
    result = env.step("Turn Right.")  # case, spacing and a full stop are forgiven
    _assert_valid(result)
    assert level.agent_dir == direction
    assert "move forward" in (result.available_actions or [])
    position = tuple(level.agent_pos)
    result = env.step("move forward")
    _assert_valid(result)
    assert tuple(level.agent_pos) == (position[0] + DIR_VECS[direction][0], position[1] + DIR_VECS[direction][1])
    assert result.info["step_count"] == 3


def test_go_to_ends_adjacent_and_facing(env: BabyAIEnv) -> None:
    first = env.reset("GoToRedBall/s0")
    targets = [a.removeprefix("go to ") for a in first.available_actions or [] if a.startswith("go to ")]
    assert len(targets) >= 3
    for name in targets[:4]:
        before = env.level_env.step_count
        result = env.step(f"go to {name}")
        if result.done:  # reached the mission's red ball on the way
            break
        _assert_valid(result)
        known = env.world.by_name(name)
        assert known is not None
        assert tuple(env.level_env.front_pos) == known.pos
        assert result.info["primitive_steps"] == env.level_env.step_count - before
        assert f"Right in front of you: {name}" in result.observation
        again = env.step(f"go to {name}")
        _assert_valid(again)
        assert again.info["primitive_steps"] == 0
        assert "already facing" in again.observation


def test_pick_up_and_drop(env: BabyAIEnv) -> None:
    first = env.reset("GoToRedBall/s0")
    name = next(a.removeprefix("pick up ") for a in first.available_actions or [] if a.startswith("pick up "))
    result = env.step(f"pick up {name}")
    _assert_valid(result)
    known = env.world.by_name(name)
    assert known is not None and env.level_env.carrying is known.obj
    assert f"You picked up {name}." in result.observation
    assert f"You are carrying {name}." in result.observation
    actions = result.available_actions or []
    assert not any(a.startswith("pick up ") for a in actions)  # hands are full
    assert f"go to {name}" not in actions
    # Turn until the cell in front is empty floor, then drop.
    for _ in range(4):
        if "drop" in (env.available_actions() or []):
            break
        env.step("turn left")
    result = env.step("drop")
    _assert_valid(result)
    assert env.level_env.carrying is None
    assert known.pos == tuple(env.level_env.front_pos)
    assert f"You dropped {name}" in result.observation
    assert f"pick up {name}" in (result.available_actions or [])


def test_toggle_doors(env: BabyAIEnv) -> None:
    task_id, name = _find_action(
        r"^toggle (\w+ door \d+)$", lambda k: isinstance(k.obj, Door) and not k.obj.is_open and not k.obj.is_locked
    )
    env.reset(task_id)
    known = env.world.by_name(name)
    assert known is not None and isinstance(known.obj, Door)
    result = env.step(f"toggle {name}")
    _assert_valid(result)
    assert tuple(env.level_env.front_pos) == known.pos
    assert known.obj.is_open and f"You opened {name}." in result.observation
    assert f"{name} (open)" in result.observation
    assert "move forward" in (result.available_actions or [])
    result = env.step(f"toggle {name}")
    _assert_valid(result)
    assert not known.obj.is_open and f"You closed {name}." in result.observation


def test_toggle_a_locked_door_without_its_key(env: BabyAIEnv) -> None:
    # Not a "go to" mission: walking up to the door could complete it before the toggle.
    task_id, name = _find_action(
        r"^toggle (\w+ door \d+)$", lambda k: isinstance(k.obj, Door) and k.obj.is_locked, skip_level="GoTo"
    )
    env.reset(task_id)
    known = env.world.by_name(name)
    assert known is not None and isinstance(known.obj, Door)
    result = env.step(f"toggle {name}")
    _assert_valid(result)  # a real (wasted) step, as in minigrid
    assert f"{name} is locked; you need to carry a {known.obj.color} key" in result.observation
    assert known.obj.is_locked and not known.obj.is_open


def test_unlock_a_door_with_its_key(env: BabyAIEnv) -> None:
    """Replay the expert on an unlock task: the door it unlocks reports so."""
    expert = BabyAIExpert()
    task_id = "UnlockLocal/s0"
    actions = expert.demonstrate(task_id)
    env.reset(task_id)
    messages = [env.step(action).observation for action in actions]
    assert any(re.search(rf"You unlocked and opened {OBJECT_NAME}\.", m) for m in messages)
    assert env.success


def test_toggle_a_box(env: BabyAIEnv) -> None:
    task_id, name = _find_action(r"^toggle (\w+ box \d+)$")
    env.reset(task_id)
    known = env.world.by_name(name)
    assert known is not None
    result = env.step(f"toggle {name}")
    _assert_valid(result)
    assert f"You opened {name};" in result.observation
    assert not known.present  # a toggled box gives way to its contents
    assert f"go to {name}" not in (result.available_actions or [])
    retry = env.step(f"go to {name}")
    assert retry.info["invalid_action"] and "no longer there" in retry.observation


def test_check_available_actions_does_not_act(env: BabyAIEnv) -> None:
    first = env.reset("BossLevel/s3")
    result = env.step("check available actions")
    _assert_valid(result)
    assert result.info["primitive_steps"] == 0 and env.level_env.step_count == 0
    assert result.observation == "You can take the following actions: " + ", ".join(first.available_actions or [])
    assert result.reward == 0.0 and not result.done


# -- invalid actions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "reason"),
    [
        ("jump", "not an action I understand"),
        ("", "not an action I understand"),
        ("go to", "not an action I understand"),
        ("go to the moon", "not an action I understand"),
        ("go to red ball 99", "have not seen"),
        ("pick up purple dragon 1", "have not seen"),
        ("toggle grey ball 1", "cannot be toggled"),
        ("drop", "not carrying anything"),
    ],
)
def test_invalid_actions(env: BabyAIEnv, action: str, reason: str) -> None:
    env.reset("GoToRedBall/s0")
    result = env.step(action)
    _assert_invalid(result, env, 0)
    assert reason in result.observation
    assert not result.done and not result.truncated


def test_invalid_pick_up_cases(env: BabyAIEnv) -> None:
    first = env.reset("GoToRedBall/s0")
    pickable = [a.removeprefix("pick up ") for a in first.available_actions or [] if a.startswith("pick up ")]
    _assert_valid(env.step(f"pick up {pickable[0]}"))
    steps = env.level_env.step_count
    result = env.step(f"pick up {pickable[1]}")
    _assert_invalid(result, env, steps)
    assert f"already carrying {pickable[0]}" in result.observation
    result = env.step(f"go to {pickable[0]}")
    _assert_invalid(result, env, steps)
    assert "you are carrying" in result.observation


def test_pick_up_a_door_is_invalid(env: BabyAIEnv) -> None:
    task_id, name = _find_action(r"^go to (\w+ door \d+)$")
    env.reset(task_id)
    result = env.step(f"pick up {name}")
    _assert_invalid(result, env, 0)
    assert "cannot be picked up" in result.observation


def test_move_forward_into_a_wall_is_invalid(env: BabyAIEnv) -> None:
    env.reset("GoToRedBall/s0")
    for _ in range(12):
        if "move forward" not in (env.available_actions() or []):
            break
        env.step("move forward")
    steps = env.level_env.step_count
    result = env.step("move forward")
    _assert_invalid(result, env, steps)
    assert "cannot move forward" in result.observation


def test_unreachable_object_is_invalid(env: BabyAIEnv) -> None:
    """Open a door, see objects behind it, close it again: they are known but out of reach."""
    for task_id in _test_ids():
        first = env.reset(task_id)
        doors = [a.removeprefix("toggle ") for a in first.available_actions or [] if re.match(r"^toggle \w+ door", a)]
        for door in doors:
            env.reset(task_id)
            known_before = {k.name for k in env.world.objects}
            opened = env.step(f"toggle {door}")
            if opened.done or "You opened" not in opened.observation:
                continue
            behind = [k.name for k in env.world.present_objects() if k.name not in known_before and k.type != "door"]
            closed = env.step(f"toggle {door}")
            if not behind or closed.done or "You closed" not in closed.observation:
                continue
            name = behind[0]
            assert f"go to {name}" not in (closed.available_actions or [])
            assert name in closed.observation  # still remembered
            result = env.step(f"go to {name}")
            _assert_invalid(result, env, env.level_env.step_count)
            assert "cannot reach" in result.observation
            return
    pytest.fail("no test task lets the agent see objects through a door")


def test_actions_after_the_episode_ended(env: BabyAIEnv) -> None:
    env.reset("GoToRedBallNoDists/s0")
    for action in BabyAIExpert().demonstrate("GoToRedBallNoDists/s0"):
        last = env.step(action)
    assert last.done and last.info["success"]
    assert env.available_actions() == []
    after = env.step("turn left")
    assert after.info["invalid_action"] and after.done and after.reward == 0.0
    assert after.score == last.score
    assert "episode is over" in after.observation


def test_normalize_action() -> None:
    assert normalize_action("  Go  To   Red Ball 1. ") == "go to red ball 1"
    assert normalize_action('"pickup blue key 2"') == "pick up blue key 2"
    assert normalize_action("forward") == "move forward"


# -- reward, termination, truncation ------------------------------------------------------------


@pytest.mark.parametrize(
    "task_id", ["GoToRedBallNoDists/s0", "PickupLoc/s3", "OpenDoorLoc/s1000001", "PutNextLocalS6N4/s2"]
)
def test_reward_matches_raw_minigrid(env: BabyAIEnv, task_id: str) -> None:
    """Replaying the expert's one-primitive macros on the raw gymnasium level gives the same reward."""
    actions = BabyAIExpert(use_macros=False).demonstrate(task_id)
    env.reset(task_id)
    task = parse_task_id(task_id)
    raw = gymnasium.make(gym_id(task.level)).unwrapped
    raw.reset(seed=task.seed)
    primitive_of = {"turn left": 0, "turn right": 1, "move forward": 2, "drop": 4}
    total_reward, raw_reward = 0.0, 0.0
    for action in actions:
        result = env.step(action)
        assert result.info["primitive_steps"] == 1
        total_reward += result.reward
        primitive = primitive_of.get(action, 3 if action.startswith("pick up") else 5)
        _, reward, terminated, _, _ = raw.step(primitive)
        raw_reward += float(reward)
        assert result.done == terminated
    assert result.done and result.info["success"]
    level = env.level_env
    expected = 1 - 0.9 * level.step_count / level.max_steps
    assert result.reward == pytest.approx(expected)
    assert result.score == pytest.approx(expected) == pytest.approx(total_reward)
    assert raw_reward == pytest.approx(expected)
    assert result.info["step_count"] == len(actions)


def test_reward_counts_primitive_steps_of_macros(env: BabyAIEnv) -> None:
    for seed in range(25):
        first = env.reset(f"GoToRedBallNoDists/s{seed}")
        if "go to red ball 1" in (first.available_actions or []):
            break
    result = env.step("go to red ball 1")
    assert result.done and result.info["success"] and not result.truncated
    steps = result.info["step_count"]
    assert steps == result.info["primitive_steps"] >= 2
    assert result.reward == pytest.approx(1 - 0.9 * steps / env.level_env.max_steps)
    assert "You completed the task." in result.observation


def test_truncation_at_max_steps() -> None:
    env = BabyAIEnv(max_steps=5)
    first = env.reset("BossLevel/s3")
    assert first.info["max_steps"] == 5
    for i in range(5):
        result = env.step("turn left")
        assert result.reward == 0.0 and not result.done
        assert result.truncated == (i == 4)
    assert "ran out of steps" in result.observation
    assert result.available_actions == [] and env.available_actions() == []
    after = env.step("turn left")
    assert after.info["invalid_action"] and after.truncated and not after.done
    # A macro is cut off by the limit too.
    env.reset("GoToRedBall/s0")
    far = [a for a in env.available_actions() or [] if a.startswith("go to ")][-1]
    result = env.step(far)
    assert result.info["primitive_steps"] <= 5


def test_success_on_the_last_allowed_step() -> None:
    task_id = "PickupLoc/s3"
    actions = BabyAIExpert().demonstrate(task_id)
    env = BabyAIEnv(max_steps=len(actions))
    env.reset(task_id)
    for action in actions:
        result = env.step(action)
    assert result.done and result.truncated and result.info["success"]  # as minigrid reports it
    assert result.reward == pytest.approx(0.1)  # 1 - 0.9 * max_steps / max_steps
    assert "You completed the task." in result.observation


def test_max_steps_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BabyAIEnv(max_steps=0)


# -- quietness, threads, memory -----------------------------------------------------------------


def test_no_stdout_chatter(capfd: pytest.CaptureFixture[str]) -> None:
    # Raw minigrid does chatter on these layouts...
    raw = gymnasium.make(gym_id("GoToObjDoor")).unwrapped
    for seed in range(3):
        raw.reset(seed=seed)
    assert "Sampling rejected" in capfd.readouterr().out
    # ...the environment, its catalog and its expert do not.
    env = BabyAIEnv()
    for level in LEVELS:
        for seed in range(3):
            env.reset(f"{level}/s{seed}")
            env.step("turn left")
    BabyAIEnv.catalog().describe("GoToObjDoor/s0")
    BabyAIExpert().demonstrate("GoToObjDoor/s1")
    out, _ = capfd.readouterr()
    assert out == ""
    assert not isinstance(sys.stdout, _DiscardWriter)


def test_instances_in_threads_match_sequential_runs() -> None:
    task_ids = _test_ids()[:12]
    expert = BabyAIExpert()
    plans = {task_id: expert.demonstrate(task_id) for task_id in task_ids}

    def play(task_id: str) -> list[str]:
        env = BabyAIEnv()
        observations = [env.reset(task_id).observation]
        observations += [env.step(action).observation for action in plans[task_id]]
        return observations

    sequential = {task_id: play(task_id) for task_id in task_ids}
    threaded: dict[str, list[str]] = {}
    lock = threading.Lock()

    def worker(ids: list[str]) -> None:
        for task_id in ids:
            observations = play(task_id)
            with lock:
                threaded[task_id] = observations

    threads = [threading.Thread(target=worker, args=(task_ids[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert threaded == sequential
    assert not isinstance(sys.stdout, _DiscardWriter)  # concurrent redirections all undone


def test_memory_of_256_live_instances() -> None:
    def rss_mib() -> float:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    ids = _test_ids()
    warm = BabyAIEnv()
    warm.reset("BossLevel/s0")
    before = rss_mib()
    envs = []
    for i in range(256):
        env = BabyAIEnv()
        env.reset(ids[i % len(ids)])
        env.step("turn left")
        envs.append(env)
    grown = rss_mib() - before
    print(f"256 live BabyAIEnv instances: +{grown:.1f} MiB RSS ({grown * 1024 / 256:.0f} KiB each)")
    assert grown < 128


# -- helpers ---------------------------------------------------------------------------------------


def _find_action(
    pattern: str, accept: Callable[[KnownObject], bool] = lambda _: True, skip_level: str | None = None
) -> tuple[str, str]:
    """The first test task offering an action matching `pattern` at reset, whose object (the
    pattern's group 1) satisfies `accept`; returns the task id and the object name. Levels whose
    name starts with `skip_level` are passed over."""
    env = BabyAIEnv()
    for task_id in _test_ids():
        if skip_level and task_id.startswith(skip_level):
            continue
        for action in env.reset(task_id).available_actions or []:
            match = re.match(pattern, action)
            known = env.world.by_name(match[1]) if match else None
            if match and known is not None and accept(known):
                return task_id, match[1]
    raise AssertionError(f"no test task offers {pattern!r} at reset")


def test_observations_without_the_action_list() -> None:
    listed, bare = BabyAIEnv(), agentgym.envs.make("babyai", list_actions=False)
    task = "GoToRedBallGrey/s1"
    full, short = listed.reset(task), bare.reset(task)
    assert "Available actions:" in full.observation
    assert "Available actions:" not in short.observation
    assert short.observation == full.observation.split("\nAvailable actions:")[0]
    assert short.available_actions == full.available_actions  # still offered through the API
    invalid = bare.step("go to red ball 1")  # not seen yet
    assert invalid.info.get("invalid_action") and "Available actions" not in invalid.observation
    assert "have not seen" in invalid.observation
    listing = bare.step("check available actions")
    assert "turn left" in listing.observation
    for action in ["turn right", "turn right", "go to red ball 1"]:  # the expert's path: same outcome
        a, b = listed.step(action), bare.step(action)
        assert (a.reward, a.done) == (b.reward, b.done)
    assert b.done and b.reward > 0
    with pytest.raises(ValueError, match="list_actions"):
        BabyAIEnv(list_actions="no")  # type: ignore[arg-type]
