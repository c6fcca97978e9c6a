"""What the agent knows about the level: the cells it has seen and the objects it has named.

Knowledge model. The agent only knows cells it has seen (minigrid's partial, occluded 7x7 view,
accumulated over the episode) and only objects it has seen; macro actions are planned over the
known passable cells, and only seen objects can be named in actions. Unseen cells count as
blocked, so a plan never relies on information the agent could not have. Because nothing in a
BabyAI level moves or changes except through the agent's own actions (picking up, dropping,
toggling happen in the cell the agent faces, which it always sees), the true grid contents of a
seen cell are exactly what the agent remembers of it; the model therefore reads seen cells from
the live grid instead of keeping a copy.

Naming. Each object gets a name ``<color> <type> <n>`` when first seen, with ``n`` counting the
objects of that color and type in order of first sighting (nearest first within one view). Names
never change during an episode, so the agent can refer to "grey door 2" across turns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from minigrid.core.constants import OBJECT_TO_IDX
from minigrid.core.world_object import WorldObj
from minigrid.envs.babyai.core.roomgrid_level import RoomGridLevel

# minigrid's directions: 0 = +x (east), 1 = +y (south), 2 = -x (west), 3 = -y (north).
DIR_VECS: tuple[tuple[int, int], ...] = ((1, 0), (0, 1), (-1, 0), (0, -1))

# Primitive minigrid actions (values of minigrid's `Actions` enum).
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = 0, 1, 2, 3, 4, 5, 6

NAMEABLE_TYPES: tuple[str, ...] = ("door", "key", "ball", "box")
PICKABLE_TYPES: tuple[str, ...] = ("key", "ball", "box")
TOGGLEABLE_TYPES: tuple[str, ...] = ("door", "box")

_NAMEABLE_IDX = np.array([OBJECT_TO_IDX[t] for t in NAMEABLE_TYPES])
_UNSEEN_IDX = OBJECT_TO_IDX["unseen"]

Pos = tuple[int, int]


def right_of(direction: int) -> tuple[int, int]:
    """The unit vector pointing to the agent's right when it faces `direction`."""
    dx, dy = DIR_VECS[direction]
    return -dy, dx


def relative(agent: Pos, direction: int, target: Pos) -> tuple[int, int]:
    """(steps in front, steps to the right) of `target` seen from `agent` facing `direction`."""
    fx, fy = DIR_VECS[direction]
    rx, ry = right_of(direction)
    dx, dy = target[0] - agent[0], target[1] - agent[1]
    return dx * fx + dy * fy, dx * rx + dy * ry


@dataclass
class KnownObject:
    """An object the agent has seen. `pos` is None while carried or once gone (opened box)."""

    name: str
    obj: WorldObj
    order: int
    pos: Pos | None
    carried: bool = False

    @property
    def type(self) -> str:
        return str(self.obj.type)

    @property
    def present(self) -> bool:
        """Still in the world: lying somewhere known, or carried."""
        return self.pos is not None or self.carried


@dataclass
class WorldModel:
    """Seen cells and named objects of one episode; updated after every primitive step."""

    width: int
    height: int
    seen: np.ndarray = field(init=False)
    objects: list[KnownObject] = field(default_factory=list)
    in_view: list[KnownObject] = field(default_factory=list)
    _by_identity: dict[int, KnownObject] = field(default_factory=dict)
    _by_name: dict[str, KnownObject] = field(default_factory=dict)
    _counters: dict[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.seen = np.zeros((self.width, self.height), dtype=bool)

    # -- updating ---------------------------------------------------------------------------

    def update(self, env: RoomGridLevel, image: np.ndarray) -> None:
        """Fold one minigrid observation image (view_size x view_size x 3) into the model."""
        view = image.shape[0]
        ax, ay = int(env.agent_pos[0]), int(env.agent_pos[1])
        direction = int(env.agent_dir)
        fx, fy = DIR_VECS[direction]
        rx, ry = right_of(direction)
        # World coordinates of view cell (0, 0): the far-left corner of the view.
        top_x = ax + fx * (view - 1) - rx * (view // 2)
        top_y = ay + fy * (view - 1) - ry * (view // 2)

        vis_i, vis_j = np.nonzero(image[:, :, 0] != _UNSEEN_IDX)
        xs = top_x - fx * vis_j + rx * vis_i
        ys = top_y - fy * vis_j + ry * vis_i
        inside = (xs >= 0) & (xs < self.width) & (ys >= 0) & (ys < self.height)
        self.seen[xs[inside], ys[inside]] = True

        # Objects in view, nearest first (ties broken by view position, so naming is deterministic).
        # The agent's own cell shows what it carries; skip it.
        agent_cell = (vis_i == view // 2) & (vis_j == view - 1)
        is_object = np.isin(image[vis_i, vis_j, 0], _NAMEABLE_IDX) & inside & ~agent_cell
        candidates: list[tuple[int, int, int, int, int]] = []
        for k in np.flatnonzero(is_object):
            front, right = view - 1 - int(vis_j[k]), int(vis_i[k]) - view // 2
            candidates.append((front + abs(right), front, right, int(xs[k]), int(ys[k])))
        candidates.sort()

        self.in_view = []
        for _, _, _, x, y in candidates:
            obj = env.grid.get(x, y)
            if obj is None or obj.type not in NAMEABLE_TYPES:
                continue
            known = self._register(obj)
            known.pos, known.carried = (x, y), False
            self.in_view.append(known)

        # Reconcile remembered objects with the agent's own doings: pick-ups, opened boxes.
        carrying = env.carrying
        for known in self.objects:
            if carrying is known.obj:
                known.pos, known.carried = None, True
            elif known.pos is not None and env.grid.get(*known.pos) is not known.obj:
                known.pos = None
                known.carried = False
            elif known.pos is None:
                known.carried = False
        if carrying is not None and id(carrying) not in self._by_identity:
            # Carried from the start (no BabyAI level in the catalog does this, but be total).
            self._register(carrying).carried = True

    def _register(self, obj: WorldObj) -> KnownObject:
        known = self._by_identity.get(id(obj))
        if known is None:
            key = (str(obj.color), str(obj.type))
            number = self._counters.get(key, 0) + 1
            self._counters[key] = number
            known = KnownObject(name=f"{key[0]} {key[1]} {number}", obj=obj, order=len(self.objects), pos=None)
            self.objects.append(known)
            self._by_identity[id(obj)] = known  # `known.obj` keeps `obj` alive, so ids stay unique
            self._by_name[known.name] = known
        return known

    # -- queries ----------------------------------------------------------------------------

    def by_name(self, name: str) -> KnownObject | None:
        return self._by_name.get(name)

    def of(self, obj: WorldObj | None) -> KnownObject | None:
        """The record of a world object, if the agent has seen it."""
        return None if obj is None else self._by_identity.get(id(obj))

    def present_objects(self) -> list[KnownObject]:
        """Objects still in the world (lying somewhere or carried), in naming order."""
        return [known for known in self.objects if known.present]

    def passable(self, env: RoomGridLevel) -> np.ndarray:
        """(width, height) mask of cells the agent knows it can stand on."""
        cells = env.grid.grid
        free = np.fromiter(
            (cell is None or cell.can_overlap() for cell in cells), dtype=bool, count=len(cells)
        ).reshape(self.height, self.width)
        return free.T & self.seen

    def reachable(self, env: RoomGridLevel, passable: np.ndarray) -> np.ndarray:
        """(width, height) mask of known cells the agent can walk to from where it stands."""
        reached = np.zeros_like(passable)
        start = (int(env.agent_pos[0]), int(env.agent_pos[1]))
        reached[start] = True
        queue: deque[Pos] = deque([start])
        while queue:
            x, y = queue.popleft()
            for dx, dy in DIR_VECS:
                nx, ny = x + dx, y + dy
                if 0 <= nx < self.width and 0 <= ny < self.height and passable[nx, ny] and not reached[nx, ny]:
                    reached[nx, ny] = True
                    queue.append((nx, ny))
        return reached

    def can_reach(self, target: Pos, reached: np.ndarray) -> bool:
        """Whether some cell next to `target` is reachable (so the agent can stand facing it)."""
        x, y = target
        return any(
            0 <= x + dx < self.width and 0 <= y + dy < self.height and reached[x + dx, y + dy] for dx, dy in DIR_VECS
        )

    def plan_to_face(self, env: RoomGridLevel, target: Pos, passable: np.ndarray) -> list[int] | None:
        """Fewest primitive actions (turn left/right, forward) that leave the agent on a known
        passable cell facing `target`; [] if it already does, None if no such plan exists.

        Breadth-first search over (x, y, direction): every primitive costs one step, which is
        also how minigrid's reward counts them.
        """
        start = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
        parents: dict[tuple[int, int, int], tuple[tuple[int, int, int], int] | None] = {start: None}
        queue: deque[tuple[int, int, int]] = deque([start])
        while queue:
            state = queue.popleft()
            x, y, d = state
            dx, dy = DIR_VECS[d]
            if (x + dx, y + dy) == target:
                actions: list[int] = []
                link = parents[state]
                while link is not None:
                    state, action = link
                    actions.append(action)
                    link = parents[state]
                return actions[::-1]
            # Forward first, so that among equally short plans straight walks win.
            successors = []
            nx, ny = x + dx, y + dy
            if 0 <= nx < self.width and 0 <= ny < self.height and passable[nx, ny]:
                successors.append(((nx, ny, d), FORWARD))
            successors.append(((x, y, (d - 1) % 4), LEFT))
            successors.append(((x, y, (d + 1) % 4), RIGHT))
            for nxt, action in successors:
                if nxt not in parents:
                    parents[nxt] = (state, action)
                    queue.append(nxt)
        return None
