"""Interactive sessions: a context, then one manoeuvre at a time, each frame sent as it is decoded.

Frame n of a session is one `RolloutJob` whose context is the frames of Terra's round that frame n
falls in (pipeline/rounds.py: 25-frame rounds, each re-seeded with the last 3 frames), whose
`frame_offset` is that round's first frame (so frame n is drawn as frame n of a whole run:
terra_cli/seeds.py), and whose affinity is the session: on vLLM that keeps the slot and salt, so
the prefix is served from the cache. On every backend, the frame's tokens are the ones a whole run
with the same actions and seed gives. Actions of the context frames are the first
step's (a constant manoeuvre then equals `terra generate --actions <preset>`).

A fork (`POST /v1/sessions/{id}/fork`) is a new session holding a copy of the parent's frames,
actions, speed and path; it draws with its lineage's next branch seed (terra_cli/seeds.py's
`branch_seed`: the c-th fork in the lineage of a session opened with seed s draws with
s + 2**20 * c), the rule terra_cli.env's `fork` follows.
"""

from __future__ import annotations

import asyncio
import base64
import math
import secrets
import time
from dataclasses import dataclass, field, replace

import numpy as np

from terra_cli.actions import ACCELERATE_ACCEL, FRAME_DT, STOP_DECEL, _step_motion, normalize_actions, preset_actions
from terra_cli.backends.base import Sampling
from terra_cli.backends.driver import RolloutJob
from terra_cli.pipeline.rounds import MAX_TOTAL_FRAMES, plan_rounds
from terra_cli.server.engine import EngineService, Handlers
from terra_cli.server.requests import MANOEUVRES, STEP_FORMATS, FieldError, check_format
from terra_cli.seeds import Lineage

PRESET_OF = {"straight": "straight", "left": "left", "right": "right", "faster": "accelerate", "brake": "stop"}
SPEED_CHANGE_KMH = {"faster": ACCELERATE_ACCEL * FRAME_DT * 3.6, "brake": -STOP_DECEL * FRAME_DT * 3.6}


class SessionsFull(Exception):
    pass


class SessionGone(Exception):
    pass


@dataclass
class Session:
    id: str
    context: np.ndarray  # (K, T) tokens
    sampling: Sampling
    start_speed: float
    tokens: list[np.ndarray] = field(default_factory=list)  # every frame so far, context first
    waypoints: list[np.ndarray] = field(default_factory=list)  # row i conditions frame i + 1
    # (x, y, heading, speed after it) at the last context frame, then after each generated frame
    path: list[tuple[float, float, float, float]] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    listeners: set = field(default_factory=set)  # asyncio.Queue per WebSocket
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    in_flight: str | None = None
    generation: int = 0  # bumped by reset: a step that began before it does not store its frame
    lineage: Lineage | None = None  # whose branch seeds this session's forks take (None: its own)
    parent: str | None = None

    def __post_init__(self):
        self.tokens = list(self.context)
        self.path = self.path or [(0.0, 0.0, 0.0, self.start_speed)]
        if self.lineage is None:
            self.lineage = Lineage(self.sampling.seed)

    @property
    def speed(self) -> float:
        """km/h now: after the last frame generated (or the start's)."""
        return self.path[-1][3]

    def public(self) -> dict:
        return {"id": self.id, "frames": len(self.tokens), "context_frames": int(self.context.shape[0]),
                "speed_kmh": round(self.speed, 3), "seed": self.sampling.seed, "parent": self.parent,
                "path": [[round(x, 3), round(y, 3)] for x, y, _, _ in self.path]}


def manoeuvre_waypoints(action, speed: float, layout) -> tuple[np.ndarray, float]:
    """One frame's (6, 3) waypoints and the speed after it."""
    if isinstance(action, str):
        name = action.strip().lower()
        if name not in MANOEUVRES:
            raise FieldError("action", f"action must be one of {', '.join(MANOEUVRES)} or (6, 3) waypoints, got {action!r}")
        waypoints = preset_actions(PRESET_OF[name], 1, speed)[0]
        return waypoints, min(max(speed + SPEED_CHANGE_KMH.get(name, 0.0), 0.0), 200.0)
    try:
        waypoints = normalize_actions(np.asarray(action, dtype=np.float64).reshape(1, layout.action_tokens, 3), "action")[0]
    except Exception as exc:
        raise FieldError("action", f"waypoints must be numbers of shape ({layout.action_tokens}, 3): {exc}") from None
    return waypoints, speed


class Sessions:
    def __init__(self, engine: EngineService, *, max_sessions: int, timeout: float, max_frames: int):
        self.engine = engine
        self.max_sessions, self.timeout = max_sessions, timeout
        self.max_frames = min(max_frames, MAX_TOTAL_FRAMES)
        self.sessions: dict[str, Session] = {}
        self.frames_sent = 0

    def __len__(self) -> int:
        return len(self.sessions)

    async def create(self, context_images: list[np.ndarray] | None, context_tokens: np.ndarray | None,
                     sampling: Sampling, speed: float) -> Session:
        if len(self.sessions) >= self.max_sessions:
            raise SessionsFull(f"{self.max_sessions} sessions are open, this server's cap")
        key = f"s-{secrets.token_hex(8)}"
        self.sessions[key] = None  # holds the place while the context is encoded
        try:
            loop = asyncio.get_running_loop()
            if context_tokens is None:
                context_tokens = await loop.run_in_executor(self.engine.media, self.engine.encode, context_images)
            session = Session(key, np.asarray(context_tokens, dtype=np.int64), sampling, speed)
        except BaseException:
            self.sessions.pop(key, None)
            raise
        self.sessions[key] = session
        return session

    async def fork(self, parent: Session) -> Session:
        """A new session with a copy of `parent`'s state (taken between its steps), seeded by the
        lineage's next branch seed."""
        from terra_cli.errors import InputError

        if len(self.sessions) >= self.max_sessions:
            raise SessionsFull(f"{self.max_sessions} sessions are open, this server's cap")
        async with parent.lock:
            if parent.closed:
                raise SessionGone(parent.id)
            try:
                seed = parent.lineage.next_seed()
            except InputError as exc:
                raise FieldError("seed", str(exc)) from None
            child = Session(f"s-{secrets.token_hex(8)}", parent.context, replace(parent.sampling, seed=seed),
                            parent.start_speed, lineage=parent.lineage, parent=parent.id)
            child.tokens, child.waypoints, child.path = list(parent.tokens), list(parent.waypoints), list(parent.path)
        self.sessions[child.id] = child
        return child

    def get(self, key: str, touch: bool = True) -> Session:
        """The open session `key`; `touch` counts the call as activity (reading its status does not)."""
        session = self.sessions.get(key)
        if session is None or session.closed:
            raise SessionGone(key)
        if touch:
            session.last_used = time.monotonic()
        return session

    def close(self, key: str) -> None:
        session = self.sessions.pop(key, None)
        if session is None:
            return
        session.closed = True
        if session.in_flight:
            self.engine.cancel(session.in_flight)
        for queue in list(session.listeners):
            queue.put_nowait(None)

    def close_all(self) -> None:
        for key in list(self.sessions):
            if self.sessions.get(key) is not None:
                self.close(key)

    def expire(self) -> list[str]:
        now = time.monotonic()
        idle = [k for k, s in self.sessions.items()
                if s is not None and not s.lock.locked() and now - s.last_used > self.timeout]
        for key in idle:
            self.close(key)
        return idle

    async def reset(self, session: Session) -> None:
        session.generation += 1
        if session.in_flight:
            self.engine.cancel(session.in_flight)
        async with session.lock:
            session.tokens = list(session.context)
            session.waypoints, session.path = [], [(0.0, 0.0, 0.0, session.start_speed)]

    async def step(self, session: Session, action, frames: int, fmt: str) -> list[dict]:
        if not 1 <= frames <= 25:
            raise FieldError("frames", f"frames must be from 1 to 25 per step, got {frames}")
        check_format(fmt, STEP_FORMATS)
        manoeuvre_waypoints(action, session.speed, self.engine.layout)  # a bad action fails before any work
        async with session.lock:
            if len(session.tokens) + frames > self.max_frames:
                raise FieldError("frames", f"the session holds {len(session.tokens)} frames and may hold at most "
                                           f"{self.max_frames}: reset it or start another", 409)
            out = []
            for _ in range(frames):
                out.append(await self._one_frame(session, action, fmt))
                session.last_used = time.monotonic()
            return out

    async def _one_frame(self, session: Session, action, fmt: str) -> dict:
        loop = asyncio.get_running_loop()
        layout = self.engine.layout
        generation = session.generation
        waypoints, speed_after = manoeuvre_waypoints(action, session.speed, layout)
        n = len(session.tokens)  # the frame to generate
        k = session.context.shape[0]
        rows = session.waypoints + [waypoints] * (n - len(session.waypoints))  # context rows: the first step's
        rnd = plan_rounds(k, n + 1, layout.max_frames)[-1]
        job = RolloutJob(f"{session.id}#{n}.{secrets.token_hex(3)}", np.stack(session.tokens[rnd.first_frame:n]),
                         np.stack(rows[rnd.first_frame:n]), n - rnd.first_frame + 1, session.sampling,
                         affinity=session.id, frame_offset=rnd.first_frame, prefix_of=session.parent)
        done: asyncio.Future = loop.create_future()

        def settle(result=None, error: BaseException | None = None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        self.engine.submit(job, Handlers(
            on_done=lambda tokens: loop.call_soon_threadsafe(settle, tokens[-1]),
            on_cancelled=lambda: loop.call_soon_threadsafe(settle, None, SessionGone(session.id)),
            on_error=lambda exc: loop.call_soon_threadsafe(settle, None, RuntimeError(str(exc)))), interactive=True)
        session.in_flight = job.key
        try:
            frame_tokens = await done
        finally:
            session.in_flight = None
        if session.closed or generation != session.generation:
            raise SessionGone(session.id)
        # "tokens": no picture decoded (pictures' GPU time runs beside the decode steps: on an H100, 32 sessions
        # through the server made 0.548 frames/s each with pictures, 0.603 with tokens, 2026-12-07e);
        # /frames/{i} decodes one later
        picture = None if fmt == "tokens" else await self.engine.pictures.picture(frame_tokens, fmt)
        session.tokens.append(np.asarray(frame_tokens, dtype=np.int64))
        session.waypoints = rows
        self._advance(session, waypoints, speed_after)
        message = self.frame_message(session, n, picture, fmt)
        for queue in list(session.listeners):
            queue.put_nowait(message)
        self.frames_sent += 1
        return message

    async def picture(self, session: Session, index: int, fmt: str = "jpeg") -> bytes:
        return await self.engine.pictures.picture(session.tokens[index], fmt)

    @staticmethod
    def _advance(session: Session, waypoints: np.ndarray, speed_after: float) -> None:
        dx, dy, dtheta = _step_motion(np.asarray(waypoints, dtype=np.float64))
        x, y, heading, _ = session.path[-1]
        c, s = math.cos(heading), math.sin(heading)
        session.path.append((x + c * dx - s * dy, y + s * dx + c * dy, heading + dtheta, speed_after))

    @staticmethod
    def frame_message(session: Session, index: int, picture: bytes | None, fmt: str) -> dict:
        """A frame's message: its picture in `fmt` as "image" (base64), or for "tokens" its codes as "tokens";
        its position and speed are the frame's own (a replay's too), the context frames' those of the last."""
        x, y, _, speed = session.path[max(0, index - (session.context.shape[0] - 1))]
        message = {"type": "frame", "session": session.id, "index": index, "format": fmt,
                   "speed_kmh": round(speed, 3), "position": [round(x, 3), round(y, 3)]}
        if picture is None:
            message["tokens"] = [int(code) for code in session.tokens[index]]
        else:
            message["image"] = base64.b64encode(picture).decode("ascii")
        return message
