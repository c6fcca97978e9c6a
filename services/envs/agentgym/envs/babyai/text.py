"""The words the agent reads: positions, objects, walls, carried item, available actions."""

from __future__ import annotations

from minigrid.core.world_object import Door
from minigrid.envs.babyai.core.roomgrid_level import RoomGridLevel

from agentgym.envs.babyai.world import DIR_VECS, KnownObject, WorldModel, relative, right_of


def steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def position_phrase(front: int, right: int) -> str:
    """E.g. "2 steps in front of you and 1 step to your right", "3 steps behind you"."""
    parts = []
    if front > 0:
        parts.append(f"{steps(front)} in front of you")
    elif front < 0:
        parts.append(f"{steps(-front)} behind you")
    if right > 0:
        parts.append(f"{steps(right)} to your right")
    elif right < 0:
        parts.append(f"{steps(-right)} to your left")
    return " and ".join(parts) if parts else "where you stand"


def door_state(door: Door) -> str:
    if door.is_open:
        return "open"
    return "locked" if door.is_locked else "closed"


def object_label(known: KnownObject) -> str:
    """The object's name plus its state where it has one: "grey door 2 (locked)"."""
    if isinstance(known.obj, Door):
        return f"{known.name} ({door_state(known.obj)})"
    return known.name


def _object_line(known: KnownObject, agent: tuple[int, int], direction: int) -> str:
    assert known.pos is not None
    front, right = relative(agent, direction, known.pos)
    return f"- {object_label(known)}: {position_phrase(front, right)}"


def _walls_phrase(env: RoomGridLevel, world: WorldModel) -> str | None:
    """Distance to the first wall straight ahead, to the left and to the right, where the
    nearest thing along that line is a wall the agent can see (doors and objects are listed
    as objects instead)."""
    ax, ay = int(env.agent_pos[0]), int(env.agent_pos[1])
    direction = int(env.agent_dir)
    rx, ry = right_of(direction)
    rays = (("in front of you", DIR_VECS[direction]), ("to your left", (-rx, -ry)), ("to your right", (rx, ry)))
    parts = []
    for where, (dx, dy) in rays:
        for distance in range(1, env.agent_view_size):
            x, y = ax + dx * distance, ay + dy * distance
            if not (0 <= x < world.width and 0 <= y < world.height) or not world.seen[x, y]:
                break
            cell = env.grid.get(x, y)
            if cell is None:
                continue
            if cell.type == "wall":
                parts.append(f"{steps(distance)} {where}")
            break
    return ", ".join(parts) if parts else None


def facing_phrase(env: RoomGridLevel, world: WorldModel) -> str:
    cell = env.grid.get(*env.front_pos)
    if cell is None:
        return "empty floor"
    if cell.type == "wall":
        return "a wall"
    known = world.of(cell)
    return object_label(known) if known is not None else f"a {cell.color} {cell.type}"


def describe_state(env: RoomGridLevel, world: WorldModel, actions: list[str] | None) -> str:
    """The agent's view in words, what it remembers, what it carries and (``actions`` given) what it can do."""
    agent = (int(env.agent_pos[0]), int(env.agent_pos[1]))
    direction = int(env.agent_dir)
    lines: list[str] = []

    visible = [known for known in world.in_view if known.pos is not None]
    if visible:
        lines.append("In view:")
        lines.extend(_object_line(known, agent, direction) for known in visible)
    else:
        lines.append("You see no objects in view.")

    walls = _walls_phrase(env, world)
    if walls:
        lines.append(f"Walls: {walls}.")
    lines.append(f"Right in front of you: {facing_phrase(env, world)}.")

    in_view_ids = {id(known) for known in visible}
    remembered = [k for k in world.objects if k.pos is not None and id(k) not in in_view_ids]
    if remembered:
        lines.append("Seen before, out of view now:")
        lines.extend(_object_line(known, agent, direction) for known in remembered)

    carried = world.of(env.carrying)
    if carried is not None:
        lines.append(f"You are carrying {carried.name}.")
    else:
        lines.append("You are not carrying anything.")
    if actions is not None:
        lines.append(available_actions_line(actions))
    return "\n".join(lines)


def available_actions_line(actions: list[str]) -> str:
    return "Available actions: " + ", ".join(actions)
