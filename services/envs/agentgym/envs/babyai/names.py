"""The BabyAI level names and their gymnasium ids.

Apart from the catalog (`levels`) because the engine needs them at import and the catalog imports the engine
(lazily, to describe a task): a module of its own keeps the two from importing each other.
"""

from __future__ import annotations

from agentgym.envs.base import UnknownTaskError

# The level set of AgentGym's BabyAI environment (agentenv-babyai, 40 levels), adjusted where
# minigrid 3.2 or the BabyAI bot demands it:
#   - the three *Debug variants AgentGym used (OpenRedBlueDoorsDebug, OpenDoorsOrderN4Debug,
#     PickupDistDebug) are replaced by their regular versions;
#   - KeyInBox and PutNextS7N4Carrying, which minigrid's BabyAIBot cannot solve, are replaced by
#     UnlockPickup and PutNextS7N4, and UnlockToUnlock, where the bot loops forever on about a
#     quarter of the layouts, by UnlockLocal;
#   - GoToObjS6 is registered as ``-v1`` in minigrid 3.2.
LEVELS: tuple[str, ...] = (
    "GoToRedBallGrey",
    "GoToRedBall",
    "GoToRedBallNoDists",
    "GoToObjS6",
    "GoToLocalS8N7",
    "GoToObjMazeS7",
    "GoToImpUnlock",
    "GoToSeqS5R2",
    "GoToRedBlueBall",
    "GoToDoor",
    "GoToObjDoor",
    "Open",
    "OpenRedDoor",
    "OpenDoorLoc",
    "OpenRedBlueDoors",
    "OpenDoorsOrderN4",
    "Pickup",
    "UnblockPickup",
    "PickupLoc",
    "PickupDist",
    "PickupAbove",
    "PutNextLocalS6N4",
    "PutNextS7N4",
    "Unlock",
    "UnlockLocalDist",
    "UnlockPickup",
    "UnlockPickupDist",
    "BlockedUnlockPickup",
    "UnlockLocal",
    "ActionObjDoor",
    "FindObjS7",
    "KeyCorridorS6R3",
    "OneRoomS20",
    "MoveTwoAcrossS8N9",
    "SynthS5R2",
    "SynthLoc",
    "SynthSeq",
    "MiniBossLevel",
    "BossLevel",
    "BossLevelNoUnlock",
)

# Levels whose current gymnasium id is not ``-v0``.
_GYM_VERSIONS: dict[str, int] = {"GoToObjS6": 1}

LEVEL_INDEX: dict[str, int] = {level: i for i, level in enumerate(LEVELS)}


def gym_id(level: str) -> str:
    """The gymnasium id of a catalog level, e.g. ``BabyAI-GoToRedBall-v0``."""
    if level not in LEVEL_INDEX:
        raise UnknownTaskError(f"unknown BabyAI level {level!r}")
    return f"BabyAI-{level}-v{_GYM_VERSIONS.get(level, 0)}"
