"""A small OpenEnv environment served on loopback for tests: :class:`GuessEnvironment` (game ``seed``: guess a
number from 1 to 10; each step says ``higher``, ``lower`` or ``right``, reward 1 when right, -0.1 otherwise, done
when right or after four guesses; a guess of 0 makes the environment raise), served by
``openenv.core.create_app`` under uvicorn on a thread of the test process (:func:`serve`), ready once its
``/health`` answers (a request sent while it starts waits in the socket's backlog)."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading

from openenv.core import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    text: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.target = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target = 1 + (seed or 0) % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text=f"Game {seed}: guess my number from 1 to 10. Answer as JSON: {{\"guess\": N}}.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if action.guess == 0:
            raise RuntimeError("guess 0 breaks the game")
        self._state.step_count += 1
        right = action.guess == self.target
        text = "right" if right else ("higher" if action.guess < self.target else "lower")
        return GuessObservation(text=text, reward=1.0 if right else -0.1,
                                done=right or self._state.step_count >= 4, metadata={"step": self._state.step_count})

    @property
    def state(self) -> State:
        return self._state


@contextlib.contextmanager
def serve(timeout: float = 60.0):
    """Serve :class:`GuessEnvironment` on 127.0.0.1 (a free port) until the block ends; yields its base URL."""
    import uvicorn

    app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=16)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # listening before the server starts: a request made now waits in the backlog until it serves
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if not healthy(port, timeout):  # answered once the server is up (the request waited for it), not polled
        raise RuntimeError(f"the OpenEnv test server did not answer /health within {timeout} s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def healthy(port: int, timeout: float) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        connection.request("GET", "/health")
        ok = connection.getresponse().status == 200
        connection.close()
        return ok
    except OSError:
        return False
