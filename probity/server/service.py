"""The server's shared state, one object every endpoint is given: its configuration, the
engine client, the admission queue, the limits and the metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .admission import Admission
from .batches import BatchLimits
from .engine_client import EngineClient
from .metrics import Metrics
from .validation import Limits


@dataclass
class Config:
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 128
    queue_timeout: float = 120.0
    accept_timeout: float = 30.0
    frame_timeout: float = 10.0
    max_restarts: int = 5
    max_body: int = 4 * 1024 * 1024
    body_timeout: float = 30.0
    allowed_hosts: list[str] = field(default_factory=list)   # empty: derived from the bind address
    cors_origins: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    engine_args: list[str] = field(default_factory=list)
    engine_command: list[str] | None = None
    batch: BatchLimits = field(default_factory=lambda: BatchLimits(Path.home() / ".cache" / "probity" / "batches"))


class Service:
    def __init__(self, config: Config):
        self.config = config
        self.limits = config.limits
        self.engine = EngineClient(config.model, accept_timeout=config.accept_timeout,
                                   frame_timeout=config.frame_timeout, max_restarts=config.max_restarts,
                                   engine_args=config.engine_args, command=config.engine_command,
                                   on_ready=self._engine_ready, on_stats=self._engine_stats)
        self.admission = Admission(capacity=1, max_queue=config.max_queue, timeout=config.queue_timeout)
        self.metrics = Metrics(self.admission, self.engine, self.limits.grammar)

    def _engine_ready(self, info: dict) -> None:
        self.admission.capacity = info["concurrency"]
        self.metrics.engine.engine_started()

    def _engine_stats(self, stats: dict) -> None:
        self.metrics.engine.report(stats)

    def ready_info(self) -> dict:
        """What the engine's last READY said. The server listens only after the first one,
        and a restart serves the same model with the same flags, so validation runs on it
        whatever the engine's state: a client fault is the same named 4xx during a restart.
        Whether the engine is up is asked only when there is work to submit."""
        if self.engine.ready_info is None:
            raise self.engine.unavailable()
        return self.engine.ready_info
