"""A rollout-engine lock as a Ray actor, in a module of its own so its worker imports little."""

from __future__ import annotations


class LockActor:
    """A rollout-engine lock as NeMo-RL-style trainers keep one: acquire() says yes or no."""

    def __init__(self) -> None:
        self.held = False
        self.times = 0

    def acquire(self) -> bool:
        if self.held:
            return False
        self.held, self.times = True, self.times + 1
        return True

    def release(self) -> None:
        self.held = False

    def state(self) -> tuple[bool, int]:
        return self.held, self.times


class SlowEngine:
    """An engine actor whose update takes ``seconds`` (a slow engine), answering SGLang-style."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def update_weights_from_distributed(self, **kwargs: object) -> tuple[bool, str]:
        import time

        time.sleep(self.seconds)  # the engine is busy: the trainer's loop must not be
        return True, f"applied {len(kwargs['names'])} tensors"  # type: ignore[arg-type]
